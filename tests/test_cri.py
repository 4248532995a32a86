"""As deployed: the node image (``make image``) under containerd's CRI, driven as a kubelet drives it.

One node for the module (``tests.crikit``: a netns and a mount namespace of its own, a containerd
with its CRI plugin on, the images imported from their OCI archives as an operator imports them),
and pods run on it through the CRI calls a kubelet makes (``tests.kit.kubelet``), from the
objects as we ship or generate them, never a copy:

- an injected pod: ``redirect inject --hold-application`` of a Pod with Istio annotations; its
  init container from our image under exactly the injected security context; the proxy (an
  image of ours plus a stand-in proxy, ``tests/cri/sidecar_proxy.py``) whose ``redirect wait``
  postStart hook holds the app back until the proxy is ready; then where the app's and the
  proxy's connections land (iptables and nftables: ``redirect init`` can't load eBPF programs
  from a pod with NET_ADMIN and NET_RAW, and ``inject`` refuses that backend);
- the node DaemonSet of ``deploy/redirect-node.yaml`` (one per backend, the ConfigMap's backend
  set as an operator sets it): its three containers from our image with the manifest's command
  lines, volumes (hostPath on the node's scratch paths), security contexts and probes; then pods
  started through the CRI on that node are captured through the thin plugin the installer put
  in place (eBPF with no kernel headers in the image and none mounted from the node), a
  kube-system pod is left alone, a bad annotation fails ``RunPodSandbox`` naming it and leaves
  nothing behind, and a removed pod leaves nothing of ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import redirect
from redirect.ambient import node as node_rules
from redirect.ambient.agent import client as agent_client
from redirect.istio.annotations import config_from_annotations
from tests import netkit
from tests.crikit import (
    BUSYBOX,
    SIDECAR_PROXY,
    Node,
    derived_image,
    needs_cri,
    node_image,
    rpc_error,
    running_node,
)
from tests.kit import secctx
from tests.kit.kubelet import Kubelet, PodFailed, PodRun
from tests.test_deploy import json_lines, the

pytestmark = [needs_cri, pytest.mark.timeout(900)]

BACKENDS = ["iptables", "nftables", "ebpf"]
PROXY_IMAGE = "rdrt-proxy:1"
T = "traffic.sidecar.istio.io/"
NODE_PORTS = (80, 22, 7070)  # node listeners: app traffic that is not captured lands on them


class Cluster:
    """The node, its kubelet, the node listeners, and the DaemonSet of one backend at a time."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.kubelet = Kubelet(node)
        self.backend: str | None = None
        self.ds: PodRun | None = None
        self.failed: dict[str, str] = {}

    # the node's own listeners (where uncaptured traffic to the node lands)
    def listeners(self) -> list[netkit.TcpListener]:
        return [netkit.TcpListener(self.node.name, p, host=self.node.gateway, label=f"node-{p}").start()
                for p in NODE_PORTS]

    @property
    def agent_socket(self) -> str:
        return str(self.node.view("/run/redirect/agent.sock"))

    def plain(self) -> None:
        """The node without our DaemonSet: removed if it runs, the node's conflist back to the bridge alone."""
        if self.ds is not None:
            ds, self.ds, self.backend = self.ds, None, None
            self.kubelet.remove(ds)
            node_rules.teardown_node(self.node.name)
        self.node.write_bridge_conflist()
        self.node.wait_cni_loaded("rdrt-pods", absent="redirect-cni")

    def daemonset(self, backend: str) -> PodRun:
        """The DaemonSet's pod with the ConfigMap's backend set to ``backend``, ready (probes answer,
        our entry installed and loaded by the CRI plugin). A start that failed fails again at once."""
        if backend in self.failed:
            raise PodFailed(f"(as before) {self.failed[backend]}")
        if self.backend == backend and self.ds is not None:
            return self.ds
        self.plain()
        ds = the("DaemonSet")
        cm = the("ConfigMap")
        data = dict(cm["data"])
        entry = json.loads(data["cni-plugin.json"])
        entry["backend"] = backend
        data["cni-plugin.json"] = json.dumps(entry, indent=2)
        self.kubelet.config_maps = {cm["metadata"]["name"]: data}
        tmpl = ds["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{ds['metadata']['name']}-{os.urandom(3).hex()}",
                            "namespace": ds["metadata"]["namespace"], "labels": tmpl["metadata"]["labels"]},
               "spec": tmpl["spec"]}
        try:
            run = self.kubelet.run_pod(pod)
        except Exception as e:
            self.failed[backend] = f"the DaemonSet's pod did not start: {rpc_error(e)}"
            raise PodFailed(self.failed[backend]) from None
        self.ds, self.backend = run, backend
        try:
            self.wait_daemonset_ready(run)
        except Exception as e:
            self.failed[backend] = str(e)
            self.plain()
            raise
        return run

    def wait_daemonset_ready(self, run: PodRun, timeout: float = 45) -> None:
        k, node = self.kubelet, self.node
        net_d, plugin = node.view("/etc/cni/net.d"), node.view("/opt/cni/bin/redirect-cni")
        deadline = time.monotonic() + timeout
        while True:
            for c in run.spec["containers"]:
                st = k.status(run, c["name"])
                if st.state != k.pb.CONTAINER_RUNNING:
                    raise PodFailed(f"DaemonSet container {c['name']} exited {st.exit_code}:"
                                    f" {k.logs(run, c['name'])[-3000:]}")
            installed = plugin.exists() and any('"redirect-cni"' in f.read_text() for f in net_d.glob("*.conflist"))
            # (the agent enrols a pod only while a node proxy is connected: it says when one is)
            if installed and 200 <= k.probe(run, "agent", "readinessProbe") < 400 and any(
                    e.get("msg") == "node proxy synced" for e in json_events(k.logs(run, "agent"))):
                break
            complaints = [e for e in json_events(k.logs(run, "install-cni")) if e.get("level") in ("warning", "error")]
            if not installed and len(complaints) >= 3:  # it retries each second, failing each time
                raise PodFailed(f"the installer keeps failing: {complaints[-1].get('msg')}")
            if time.monotonic() > deadline:
                raise PodFailed(f"DaemonSet not ready after {timeout} s (installed: {installed}): "
                                + " | ".join(f"{c['name']}: {k.logs(run, c['name'])[-1500:]}"
                                             for c in run.spec["containers"]))
            time.sleep(0.1)
        node.wait_cni_loaded('"redirect-cni"')

    def app_pod(self, name: str, namespace: str = "default",
                annotations: dict[str, str] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": namespace}
        if annotations:
            meta["annotations"] = annotations
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "app", "image": BUSYBOX, "command": ["sleep", "2147483647"]}]}}

    def accepts(self, uid: str) -> list[dict[str, Any]]:
        """The node proxy's accepted connections of the pod ``uid`` (its log's JSON lines)."""
        assert self.ds is not None
        return [e for e in json_events(self.kubelet.logs(self.ds, "node-proxy"))
                if e.get("event") == "accept" and e.get("pod") == uid]

    def ours(self, run: PodRun) -> list[str]:
        """What of ours the node holds for the pod: its agent enrolment, node-set entries, eBPF
        registrations (every registered pod: the DaemonSet's pod has none)."""
        out = []
        if os.path.exists(self.agent_socket):
            out += [f"agent: {p}" for p in agent_client.list_pods(self.agent_socket) if run.uid in str(p.get("uid"))]
        out += [f"node set: {ip}" for ip, owner in node_rules.list_pods(self.node.name).items()
                if run.uid in str(owner) or ip == run.ip]
        if self.backend == "ebpf":
            from redirect.backends import ebpf

            out += [f"ebpf pod {c}" for c in ebpf.registered_pods(self.node.bpf_root)]
        return out

    def left_behind(self, run: PodRun) -> list[str]:
        """What is left of a removed pod: the above, its netns pin, the CNI results cached for it."""
        results = self.node.view("/var/lib/cni/results")
        cached = [f.name for f in results.iterdir() if run.sandbox_id in f.name] if results.is_dir() else []
        pin = [run.pin] if run.pin and self.node.view(run.pin).exists() else []
        return [*self.ours(run), *pin, *cached]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    image = node_image()  # built by deploy/build-image.sh unless up to date
    with running_node() as node:
        c = Cluster(node)
        node.import_image(image, "redirect:0.1.0")
        proxy = derived_image(image, node.base / "proxy.tar", PROXY_IMAGE,
                              {"usr/local/lib/rdrt/sidecar_proxy.py": SIDECAR_PROXY.read_bytes()},
                              ["python3", "/usr/local/lib/rdrt/sidecar_proxy.py"])
        node.import_image(proxy, PROXY_IMAGE)
        try:
            yield c
        finally:
            if c.ds is not None:
                try:
                    c.kubelet.remove(c.ds)
                finally:
                    node_rules.teardown_node(node.name)


def wait_for(what: str, fn: Any, timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while not (v := fn()):
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.05)
    return v


def json_events(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def exec_ok(k: Kubelet, run: PodRun, name: str, cmd: list[str], timeout: float = 20) -> str:
    r = k.exec(run, name, cmd, timeout)
    assert r.exit_code == 0, (cmd, r.exit_code, r.stderr.decode()[-2000:])
    return str(r.stdout.decode())


def nc(k: Kubelet, run: PodRun, ip: str, port: int) -> str:
    """One connection from the pod's app container (busybox nc); the line that answered it."""
    return exec_ok(k, run, "app", ["sh", "-c", f"echo hi | nc -w 3 {ip} {port}"]).strip()


# --- an injected pod ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["iptables", "nftables"])
def test_an_injected_pod_starts_from_the_image_and_its_traffic_lands_as_its_annotations_mean(
        cluster: Cluster, backend: str) -> None:
    cluster.plain()
    k, node = cluster.kubelet, cluster.node
    annotations = {T + "excludeOutboundPorts": "22", T + "includeInboundPorts": "8080"}
    pod = cluster.app_pod(f"web-{os.urandom(2).hex()}", "shop", annotations)
    pod["spec"]["containers"][0]["command"] = [
        "sh", "-c", "nc -ll -p 8080 -e echo app-8080 & nc -ll -p 9090 -e echo app-9090 & exec sleep 2147483647"]
    p = subprocess.run([sys.executable, "-m", "redirect.cli", "inject", "--proxy-image", PROXY_IMAGE,
                        "--hold-application", "--backend", backend], input=yaml.safe_dump(pod),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    (injected,) = [d for d in yaml.safe_load_all(p.stdout) if d]
    spec = injected["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["redirect-init"]
    assert [c["name"] for c in spec["containers"]] == ["redirect-proxy", "app"]
    assert spec["initContainers"][0]["image"] == "redirect:0.1.0"  # inject's default: the image make image builds

    run = k.sandbox(injected)
    listeners = cluster.listeners()
    try:
        # the init container, from our image, under exactly the injected security context: root,
        # NET_ADMIN and NET_RAW and nothing else, no privilege escalation
        k.create_and_start(run, "redirect-init")
        assert k.status(run, "redirect-init").image_ref == k.image_id("redirect:0.1.0")
        process = k.runtime_spec(run, "redirect-init")["process"]
        assert (process["user"]["uid"], process["user"]["gid"], process["noNewPrivileges"]) == (0, 0, True)
        for kind in ("bounding", "effective", "permitted"):
            assert sorted(process["capabilities"][kind]) == ["CAP_NET_ADMIN", "CAP_NET_RAW"], process
        k.wait_init_done(run, "redirect-init")
        # the proxy (uid/gid 1337, no capabilities), then its postStart hook (redirect wait): it holds
        # the app back until the proxy is ready
        k.create_and_start(run, "redirect-proxy")
        process = k.runtime_spec(run, "redirect-proxy")["process"]
        assert (process["user"]["uid"], process["user"]["gid"]) == (1337, 1337)
        assert not any(process.get("capabilities", {}).values()), process
        hook: dict[str, Any] = {}
        t = threading.Thread(target=lambda: hook.update(r=k.post_start(run, "redirect-proxy")), daemon=True)
        t.start()
        wait_for("the hook asking the proxy twice", lambda: len(
            [e for e in json_events(k.logs(run, "redirect-proxy")) if e.get("status") == 503]) >= 2)
        assert t.is_alive(), f"the hook returned while the proxy answered 503: {hook}"
        exec_ok(k, run, "redirect-proxy", ["touch", "/tmp/ready"])
        t.join(30)
        assert not t.is_alive() and hook["r"].exit_code == 0, hook
        k.create_and_start(run, "app")
        gw, ip = node.gateway, run.ip
        wait_for("the app's listeners", lambda: netkit.tcp_probe(node.name, ip, 9090) == "app-9090")

        # outbound: captured to the proxy's 15001 with the original destination, except port 22
        assert nc(k, run, gw, 80) == f"outbound {gw}:80"
        assert nc(k, run, gw, 22) == "node-22"
        # the proxy's own connections (uid 1337) are not captured
        own = exec_ok(k, run, "redirect-proxy", ["python3", "-c", (
            f"import socket; s = socket.create_connection(({gw!r}, 80), 3); s.sendall(b'x\\n'); "
            "print(s.makefile().readline().strip())")])
        assert own.strip() == "node-80"
        # inbound: 8080 captured to 15006, 9090 (not included) reaches the app
        assert netkit.tcp_probe(node.name, ip, 8080) == f"inbound {ip}:8080"
        assert netkit.tcp_probe(node.name, ip, 9090) == "app-9090"
        # what is installed is exactly what the annotations mean
        res = redirect.check(run.netns, config_from_annotations(annotations))
        assert res.ok, res.differences
    finally:
        for lst in listeners:
            lst.close()
        k.remove(run)


# --- the node DaemonSet --------------------------------------------------------------------------


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The backend of the DaemonSet; the module's tests are grouped by it, one DaemonSet each."""
    return str(request.param)


def test_the_daemonsets_containers_run_from_the_image_as_the_manifest_says(cluster: Cluster, backend: str) -> None:
    run = cluster.daemonset(backend)
    k = cluster.kubelet
    image = k.image_id("redirect:0.1.0")
    for c in run.spec["containers"]:
        name = c["name"]
        st = k.cri.runtime.ContainerStatus(k.pb.ContainerStatusRequest(container_id=run.containers[name], verbose=True),
                                           timeout=10)
        assert st.status.image_ref == image, name
        pid = json.loads(st.info["info"])["pid"]  # hostPID: the container's processes are the node's
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
        argv = [a.replace("$(NODE_NAME)", cluster.node.name) for a in c["command"]]
        assert [a.decode() for a in cmdline[-len(argv) + 1:]] == argv[1:] and cmdline[1].decode().endswith(argv[0])
        got, want = secctx.read_status(pid), secctx.creds_of(c, run.spec)
        assert (got.uid, got.gid, got.bounding, got.effective, got.no_new_privs) == \
            (want.uid, want.gid, want.bounding, want.effective, want.no_new_privs), (name, got, want)
        # --log-json: every line a JSON record (a container writes its first line in its own time)
        json_lines(wait_for(f"{name}'s first log line", lambda name=name: k.logs(run, name).strip(), timeout=60))
    for probe in ("livenessProbe", "readinessProbe"):
        assert k.probe(run, "agent", probe) == 200
    # the node has no kernel headers in the image's view, nor mounted into it
    r = k.exec(run, "agent", ["sh", "-c", "test -e /lib/modules || test -e /usr/src/linux-headers-$(uname -r)"])
    assert r.exit_code == 1, r
    # the installer's entry, as it wrote it, is the ConfigMap's (backend included)
    conf = [json.loads(f.read_text()) for f in cluster.node.view("/etc/cni/net.d").glob("*.conflist")]
    (entry,) = [p for c in conf for p in c["plugins"] if p["type"] == "redirect-cni"]
    assert entry["backend"] == backend and entry["mode"] == "ambient"


def test_a_pod_on_the_node_is_captured_and_leaves_nothing_when_removed(cluster: Cluster, backend: str) -> None:
    cluster.daemonset(backend)
    k, node = cluster.kubelet, cluster.node
    run = k.run_pod(cluster.app_pod(f"app-{os.urandom(2).hex()}"))
    removed = False
    listeners = cluster.listeners()
    try:
        (pod,) = [p for p in agent_client.list_pods(cluster.agent_socket) if run.uid in str(p.get("uid"))]
        assert pod["ips"] == [run.ip] and pod["name"] == run.name and pod["namespace"] == "default"
        assert run.ip in node_rules.list_pods(node.name)  # the kubelet's probes reach it
        assert nc(k, run, node.gateway, 7070) == "node-7070"  # through the node proxy, which connects onwards
        (accept,) = cluster.accepts(run.uid)
        assert accept["orig_dst"] == [node.gateway, 7070], accept
        # the node proxy's listeners in the pod carry their handover program (its container may load it)
        events = [e for e in json_events(k.logs(cluster.daemonset(backend), "node-proxy")) if e.get("pod") == run.uid]
        assert [e["event"] for e in events if e.get("event") in ("pod_added", "no_handover")] == ["pod_added"], events
        k.remove(run)
        removed = True
        assert run.pin and cluster.left_behind(run) == []
    finally:
        for lst in listeners:
            lst.close()
        if not removed:
            k.remove(run)


def test_a_kube_system_pod_is_left_alone(cluster: Cluster, backend: str) -> None:
    cluster.daemonset(backend)
    k, node = cluster.kubelet, cluster.node
    run = k.run_pod(cluster.app_pod(f"dns-{os.urandom(2).hex()}", "kube-system"))
    listeners = cluster.listeners()
    try:
        assert cluster.ours(run) == []
        assert nc(k, run, node.gateway, 7070) == "node-7070"
        assert listeners[2].wait_for(1)[-1].peer[0] == run.ip
        assert cluster.accepts(run.uid) == []  # straight to the node, not through the node proxy
        if backend != "ebpf":
            assert redirect.show(run.netns)["backends"] == []
    finally:
        for lst in listeners:
            lst.close()
        k.remove(run)


def test_a_bad_annotation_fails_run_pod_sandbox_naming_it_and_leaves_nothing(cluster: Cluster, backend: str) -> None:
    cluster.daemonset(backend)
    k, node = cluster.kubelet, cluster.node
    pins = set(os.listdir(node.view("/run/netns")))
    leases = set(os.listdir(node.view("/var/lib/cni/networks/rdrt-pods")))
    cached = set(os.listdir(node.view("/var/lib/cni/results")))
    pod = cluster.app_pod(f"bad-{os.urandom(2).hex()}", annotations={T + "excludeOutboundPorts": "22,ssh"})
    with pytest.raises(Exception) as e:
        k.sandbox(pod)
    msg = rpc_error(e.value)
    assert T + "excludeOutboundPorts" in msg and "22,ssh" in msg, msg
    names = [s.metadata.name for s in k.cri.runtime.ListPodSandbox(k.pb.ListPodSandboxRequest(), timeout=10).items]
    assert pod["metadata"]["name"] not in names
    assert set(os.listdir(node.view("/run/netns"))) == pins
    assert set(os.listdir(node.view("/var/lib/cni/networks/rdrt-pods"))) == leases
    assert set(os.listdir(node.view("/var/lib/cni/results"))) == cached
    assert [p for p in agent_client.list_pods(cluster.agent_socket) if p.get("name") == pod["metadata"]["name"]] == []
    assert node_rules.list_pods(node.name) == {}
    if backend == "ebpf":
        from redirect.backends import ebpf

        assert ebpf.registered_pods(node.bpf_root) == []
