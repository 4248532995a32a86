"""``redirect inject``: every injected kind validates against the Kubernetes schemas (offline,
``kubernetes-validate`` ships them), injecting is idempotent, what can't be injected is refused,
and the init container's command line, run in a real pod netns, installs exactly the config
the pod's Istio annotations mean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import kubernetes_validate
import pytest
import yaml

import redirect
from redirect.errors import ConfigError
from redirect.istio.annotations import config_from_annotations
from redirect.istio.flags import config_from_istio_args
from redirect.k8s import inject
from redirect.kernel import netns as rnetns
from tests import netkit
from tests.kit import secctx
from tests.netkit import Pod, TcpListener, UdpListener, landing
from tests.test_wait import health

K8S_VERSION = "1.30"
T = "traffic.sidecar.istio.io/"
APP = {"name": "app", "image": "nginx:1.27", "ports": [{"containerPort": 8080}]}


def validate(obj: dict[str, Any]) -> None:
    """Strict schema validation (unknown fields are errors), with a short message on failure."""
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{obj.get('kind')}: {e.message} at {list(e.path)}") from None


def template(annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": {"app": "web"}}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": {"containers": [dict(APP)], **spec}}


def workloads(annotations: dict[str, str] | None = None) -> list[dict[str, Any]]:
    sel = {"matchLabels": {"app": "web"}}
    pod = template(annotations)
    job_pod = template(annotations, restartPolicy="Never")
    return [
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", **({"annotations": annotations}
                                                                            if annotations else {})},
         "spec": pod["spec"]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
         "spec": {"replicas": 2, "selector": sel, "template": pod}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "db"},
         "spec": {"serviceName": "db", "selector": sel, "template": pod}},
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "agent"},
         "spec": {"selector": sel, "template": pod}},
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": "rs"},
         "spec": {"selector": sel, "template": pod}},
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "once"}, "spec": {"template": job_pod}},
        {"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "nightly"},
         "spec": {"schedule": "0 3 * * *", "jobTemplate": {"spec": {"template": job_pod}}}},
    ]


SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
           "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    kind = obj["kind"]
    if kind == "Pod":
        return obj["spec"]
    if kind == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return obj["spec"]["template"]["spec"]


def run_inject(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "redirect.cli", "inject", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


# --- every kind, validated -----------------------------------------------------------------------


@pytest.mark.parametrize("hold", [False, True])
def test_every_kind_in_a_stream_is_injected_and_validates(hold: bool) -> None:
    objs = [*workloads({T + "excludeOutboundPorts": "22", "sidecar.istio.io/interceptionMode": "TPROXY"}), SERVICE]
    for o in objs:
        validate(o)  # the input is valid to begin with
    stream = yaml.safe_dump_all(objs, sort_keys=False)
    args = ["--proxy-image", "envoyproxy/envoy:v1.31.0", "--image", "registry.local/redirect:0.1.0"]
    p = run_inject(*args, *(["--hold-application"] if hold else []), stdin=stream)
    assert p.returncode == 0, p.stderr
    out = list(yaml.safe_load_all(p.stdout))
    assert [o["kind"] for o in out] == [o["kind"] for o in objs]
    assert out[-1] == SERVICE  # no pod template: passed through as it was
    for o in out:
        validate(o)
    for o in out[:-1]:
        spec = pod_spec(o)
        init, *rest = spec["initContainers"]
        assert init["name"] == "redirect-init" and not rest and init["image"] == "registry.local/redirect:0.1.0"
        assert init["command"][:2] == ["redirect", "init"]
        assert init["securityContext"]["capabilities"] == {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]}
        assert init["securityContext"]["runAsUser"] == 0
        names = [c["name"] for c in spec["containers"]]
        assert names == (["redirect-proxy", "app"] if hold else ["app", "redirect-proxy"])
        proxy = spec["containers"][names.index("redirect-proxy")]
        sc = proxy["securityContext"]
        # TPROXY: transparent sockets, so root (in the proxy's group) with NET_ADMIN alone
        assert (sc["runAsUser"], sc["runAsGroup"], sc["runAsNonRoot"], sc["allowPrivilegeEscalation"]) == \
            (0, 1337, False, False)
        assert sc["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
        app = spec["containers"][names.index("app")]
        assert "securityContext" not in app  # the app gets nothing
        if hold:
            hook = proxy["lifecycle"]["postStart"]["exec"]["command"]
            assert hook == ["redirect", "wait", "--url", "http://localhost:15020/healthz/ready", "--timeout", "60"]
        else:
            assert "lifecycle" not in proxy
    # a List (kubectl get -o yaml) and JSON in, JSON out
    lst = {"apiVersion": "v1", "kind": "List", "items": objs}
    p = run_inject(*args, stdin=json.dumps(lst))
    assert p.returncode == 0, p.stderr
    out_list = json.loads(p.stdout)
    assert out_list["kind"] == "List" and len(out_list["items"]) == len(objs)
    for o in out_list["items"]:
        validate(o)


def test_injecting_twice_changes_nothing_and_other_options_replace_the_injection() -> None:
    stream = yaml.safe_dump_all([*workloads({T + "includeInboundPorts": "8080"}), SERVICE], sort_keys=False)
    opts = inject.InjectOptions(proxy_image="envoy:1", hold_application=True, log_json=True)
    once = inject.inject_text(stream, opts)
    assert inject.inject_text(once, opts) == once
    assert inject.inject_text(inject.inject_text(once, opts), opts) == once
    # without the proxy: the earlier proxy container goes, the app's containers stay as they were
    plain = inject.InjectOptions()
    replaced = inject.inject_text(once, plain)
    assert replaced == inject.inject_text(stream, plain)
    for o in yaml.safe_load_all(replaced):
        if o["kind"] != "Service":
            assert [c["name"] for c in pod_spec(o)["containers"]] == ["app"]
            validate(o)
    # the user's own init containers stay, after ours
    pod = workloads()[0]
    pod["spec"]["initContainers"] = [{"name": "migrate", "image": "busybox"}]
    twice = inject.inject_object(inject.inject_object(pod, opts), opts)
    assert [c["name"] for c in twice["spec"]["initContainers"]] == ["redirect-init", "migrate"]
    assert twice == inject.inject_object(pod, opts)


# --- Istio annotations -> init flags -> the same config ---------------------------------------------

ANNOTATION_CASES: list[dict[str, str]] = [
    {},
    {T + "excludeOutboundPorts": "22,5432", T + "excludeInboundPorts": "9000"},
    {T + "includeOutboundIPRanges": "10.0.0.0/8,192.168.0.0/16", T + "excludeOutboundIPRanges": "10.96.0.1/32"},
    {T + "includeInboundPorts": "8080,9090", T + "includeOutboundPorts": "443",
     "status.sidecar.istio.io/port": "15999"},
    {"sidecar.istio.io/interceptionMode": "TPROXY", T + "excludeInterfaces": "eth1"},
    {"sidecar.istio.io/proxyUID": "1400", "sidecar.istio.io/proxyGID": "1401",
     "istio.io/reroute-virtual-interfaces": "net1,net2"},
    {T + "includeOutboundIPRanges": "", T + "includeInboundPorts": "", T + "kubevirtInterfaces": "vm0"},
]


@pytest.mark.parametrize("annotations", ANNOTATION_CASES, ids=range(len(ANNOTATION_CASES)))
def test_istio_annotations_round_trip_through_the_init_flags(annotations: dict[str, str]) -> None:
    pod = inject.inject_object(workloads(annotations)[0], inject.InjectOptions(proxy_image="envoy:1"))
    validate(pod)
    command = pod["spec"]["initContainers"][0]["command"]
    assert command[:2] == ["redirect", "init"]
    want = config_from_annotations(annotations)
    assert config_from_istio_args(command[2:], env={}) == want
    proxy = pod["spec"]["containers"][-1]["securityContext"]
    user = 0 if want.inbound_interception == "TPROXY" else want.proxy_uids[0]  # (transparent sockets: root)
    assert (proxy["runAsUser"], proxy["runAsGroup"]) == (user, want.proxy_gids[0])


# --- the injected containers, run as the runtime runs them ---------------------------------------

#: Downward-API values of the pod the containers run in.
POD_FIELDS = {"metadata.name": "web-0", "metadata.namespace": "shop", "metadata.uid": "0b1c"}


def container_env(c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet makes it (its ``env``: values, downward-API
    fields), with the image's PATH (where ``redirect`` is: this tree's console scripts)."""
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    for e in c.get("env", []):
        env[e["name"]] = e["value"] if "value" in e else POD_FIELDS[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def container_argv(c: dict[str, Any], spec: dict[str, Any], netns: str | None,
                   command: list[str] | None = None) -> list[str]:
    """What runs ``command`` (default: the container's own) as a container runtime runs container
    ``c`` of the pod ``spec``: in the pod's netns (None: this process's), in a mount namespace of its
    own with a private ``/run`` (a tmpfs, as the runtime mounts it: no lock or file of the node's
    there) and ``/proc/sys`` read-only (as a runtime makes it for a container that is not
    privileged), with exactly the credentials its security context gives (``tests.kit.secctx``)."""
    creds = secctx.creds_of(c, spec)
    enter = ["nsenter", f"--net={rnetns.path_of(netns)}", "--"] if netns is not None else []
    mounts = ["mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run", "mount --bind /proc/sys /proc/sys",
              "mount -o remount,bind,ro /proc/sys"]
    return [*enter, "unshare", "--mount", "--propagation", "private", "sh", "-c",
            " && ".join([*mounts, 'exec "$@"']), "sh", *creds.setpriv(),
            *(command if command is not None else c["command"])]


def as_container(c: dict[str, Any], spec: dict[str, Any], netns: str | None, command: list[str] | None = None,
                 timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``container_argv`` run to its end, with the container's env."""
    return subprocess.run(container_argv(c, spec, netns, command), capture_output=True, text=True, timeout=timeout,
                          env=container_env(c))


def injected_pod(annotations: dict[str, str], **opts: Any) -> dict[str, Any]:
    pod = inject.inject_object(workloads(annotations)[0], inject.InjectOptions(proxy_image="envoy:1", **opts))
    validate(pod)
    return dict(pod["spec"])


TPROXY = {"sidecar.istio.io/interceptionMode": "TPROXY"}
INIT_CASES = [  # (backend of redirect inject, the pod's annotations)
    ("iptables", {}),
    ("iptables-legacy", {T + "excludeOutboundPorts": "9090"}),
    ("iptables-nft", {T + "includeInboundPorts": "8080"}),
    ("nftables", {}),
    ("iptables", TPROXY),
    ("nftables", TPROXY),
]


@pytest.mark.parametrize("backend,annotations", INIT_CASES, ids=[f"{b}-{i}" for i, (b, _) in enumerate(INIT_CASES)])
def test_the_injected_init_container_captures_under_its_own_security_context(
        pod: Pod, backend: str, annotations: dict[str, str]) -> None:
    """The init container exactly as injected (command, env, security context: root with NET_ADMIN
    and NET_RAW only, no_new_privs, a private /run) installs in its pod's netns what the annotations
    mean, every backend it can be told to use: the app's connections land at the proxy's outbound
    listener with their original destination, inbound ones at its inbound listener, and the
    proxy's passthrough from ``::6`` (the address the plan adds on lo) reaches the app. Its
    ``--cleanup-only`` under the same credentials takes all of it out again."""
    spec = injected_pod(annotations, backend=backend)
    init = spec["initContainers"][0]
    assert secctx.creds_of(init, spec).effective == {"NET_ADMIN", "NET_RAW"}  # what the YAML grants
    cfg = config_from_annotations(annotations)
    tproxy = cfg.inbound_interception == "TPROXY"
    try:
        p = as_container(init, spec, pod.name)
        assert p.returncode == 0, p.stderr
        res = redirect.check(pod.name, cfg, backend=None)
        assert res.ok and res.backend.startswith(backend.split("-")[0]), (res.backend, res.differences)
        for fam in (4, 6):
            with TcpListener(pod.name, 15001, family=fam, label="proxy-out") as out, \
                    TcpListener(pod.name, 15006, family=fam, transparent=tproxy, label="proxy-in") as inb, \
                    TcpListener(pod.name, 8080, family=fam, label="app") as app, \
                    TcpListener(pod.peer_name, 8080, family=fam, label="peer") as peer:
                hit = landing(pod.name, pod.peer_ip(fam), 8080, out, peer, uid=1000)
                assert hit.label == "proxy-out" and hit.orig_dst == (pod.peer_ip(fam), 8080), (fam, hit.result)
                hit = landing(pod.peer_name, pod.pod_ip(fam), 8080, inb, app)
                assert hit.label == "proxy-in", (fam, hit.result)
                assert (hit.local if tproxy else hit.orig_dst) == (pod.pod_ip(fam), 8080)
                six = "127.0.0.6" if fam == 4 else "::6"
                hit = landing(pod.name, pod.pod_ip(fam), 8080, inb, app, uid=1337, src=six)
                assert hit.label == "app", (fam, hit.result)
        p = as_container(init, spec, pod.name, [*init["command"], "--cleanup-only"])
        assert p.returncode == 0 and "removed" in p.stdout, p.stderr
        assert not redirect.show(pod.name)["installed"]
        routing = subprocess.run(["ip", "-n", pod.name, "-6", "addr", "show", "dev", "lo"], capture_output=True,
                                 text=True, check=True).stdout + subprocess.run(
            ["ip", "-n", pod.name, "rule"], capture_output=True, text=True, check=True).stdout
        assert "::6/" not in routing and "lookup 133" not in routing, routing
    finally:
        redirect.teardown(pod.name)


#: A TPROXY proxy's two sockets, run as the injected proxy container: a transparent listener on the
#: inbound port (it says "ready", takes one connection and prints its local address), then a
#: connection of its own to argv[1]:9090 (it prints the answer).
TPROXY_PROXY = r"""
import json, socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_IP, 19, 1)  # IP_TRANSPARENT: CAP_NET_ADMIN in effect, or EPERM
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 15006))
s.listen(4)
s.settimeout(20)
print("ready", flush=True)
c, _ = s.accept()
local = c.getsockname()
c.close()
o = socket.create_connection((sys.argv[1], 9090), timeout=10)
o.settimeout(10)
o.sendall(b"proxy\n")
print(json.dumps({"local": list(local), "answer": o.recv(64).decode().strip()}), flush=True)
"""


@pytest.mark.parametrize("backend", ["iptables", "nftables"])
def test_the_injected_tproxy_proxy_opens_transparent_sockets_and_its_own_traffic_is_not_captured(
        pod: Pod, backend: str) -> None:
    """Under TPROXY the injected proxy container (root in the proxy's group, ``NET_ADMIN`` alone, as
    Istio's template has it) can open the transparent listener TPROXY delivers to: a connection to
    the app's port lands there with the app's address as its local one. Its own connection out
    reaches its destination uncaptured: the capture leaves the proxy's group alone."""
    spec = injected_pod(TPROXY, backend=backend)
    init, proxy = spec["initContainers"][0], spec["containers"][-1]
    creds = secctx.creds_of(proxy, spec)
    assert (creds.uid, creds.gid, creds.effective) == (0, 1337, frozenset({"NET_ADMIN"}))
    assert creds.no_new_privs
    try:
        p = as_container(init, spec, pod.name)
        assert p.returncode == 0, p.stderr
        with TcpListener(pod.name, 15001, label="proxy-out") as out, \
                TcpListener(pod.peer_name, 9090, label="peer") as peer:
            proc = subprocess.Popen(container_argv(proxy, spec, pod.name, [sys.executable, "-c", TPROXY_PROXY,
                                                                             pod.peer_ip4]),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=container_env(proxy))
            try:
                assert proc.stdout is not None
                first = proc.stdout.readline()  # (the script's own accept timeout bounds this)
                assert first.strip() == "ready", (first, proc.stderr.read() if proc.stderr else "")
                netkit.connect_as(pod.peer_name, pod.pod_ip4, 8080, 0).close()
                got, err = proc.communicate(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
            assert proc.returncode == 0, err
            res = json.loads(got.strip().splitlines()[-1])
            assert res == {"local": [pod.pod_ip4, 8080], "answer": "peer"}, res
            assert peer.wait_for(1) and not out.conns, (peer.conns, out.conns)
    finally:
        redirect.teardown(pod.name)


def test_init_validation_dns_and_ebpf_under_the_injected_security_contexts(pod: Pod) -> None:
    """What else ``redirect init`` may be asked for, under the injected security contexts: DNS
    capture works as the init container; ``--run-validation`` as the init container says it lacks
    CAP_SETUID (it would connect as the proxy) before installing anything, and succeeds as the
    proxy container (Istio's validation container: ``--skip-rule-apply`` as the proxy's uid, no
    capabilities); the eBPF backend, which an init container cannot run, is refused naming the
    missing capability rather than failing half-way."""
    spec = injected_pod({})
    init, proxy = spec["initContainers"][0], spec["containers"][-1]
    assert proxy["name"] == "redirect-proxy" and secctx.creds_of(proxy, spec).effective == frozenset()
    try:
        p = as_container(init, spec, pod.name, [*init["command"], "--run-validation"])
        assert p.returncode == 1 and "lacks CAP_SETUID and CAP_SETGID" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr and not redirect.show(pod.name)["installed"]
        dns = [*init["command"], "--redirect-dns", "--capture-all-dns"]
        p = as_container(init, spec, pod.name, dns)
        assert p.returncode == 0, p.stderr
        assert redirect.check(pod.name, config_from_istio_args(dns[2:], env={})).ok
        # (the DNS proxy answers as the proxy uid: its answers are what conntrack un-NATs)
        with UdpListener(pod.name, 15053, label="dns-proxy", owner=(1337, 1337)) as dns_proxy, \
                UdpListener(pod.peer_name, 53, label="resolver") as resolver:
            hit = landing(pod.name, pod.peer_ip4, 53, dns_proxy, resolver, proto="udp", uid=1000)
            assert hit.label == "dns-proxy", hit.result
        p = as_container(proxy, spec, pod.name, [*init["command"], "--run-validation", "--skip-rule-apply"])
        assert p.returncode == 0 and "captured on 15006" in p.stdout, (p.stdout, p.stderr)
        assert redirect.teardown(pod.name)
        p = as_container(init, spec, pod.name, ["redirect", "setup", "/proc/self/ns/net", "--allow-host-netns",
                                                "--backend", "ebpf"])
        assert p.returncode == 1 and "lacks CAP_BPF" in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert not redirect.show(pod.name)["installed"]
        p = as_container(init, spec, pod.name, ["redirect", "-v", "setup", "/proc/self/ns/net", "--allow-host-netns",
                                                "--backend", "auto"])  # auto passes eBPF over, saying why
        assert p.returncode == 0 and "not ebpf (ebpf: this process lacks CAP_BPF" in p.stderr, p.stderr
        assert redirect.show(pod.name)["backend"] in ("nftables", "iptables")
    finally:
        redirect.teardown(pod.name)


def test_the_injected_init_container_in_the_hosts_netns_is_still_refused() -> None:
    """Without setns the init container installs in whatever netns it runs in: run (with its
    credentials) in the host's, it is refused as a full-root run is, and leaves nothing."""
    from tests.test_host_and_locks import host_capture

    spec = injected_pod({})
    init = spec["initContainers"][0]
    before = host_capture()
    # (a command that would capture nothing even if it were not refused)
    p = as_container(init, spec, None, ["redirect", "init", "-p", "15001"])
    assert p.returncode == 1 and "host's initial network namespace" in p.stderr, p.stderr
    assert host_capture() == before


def test_the_injected_init_command_installs_what_the_annotations_mean(pod: Pod) -> None:
    """The exact command line of the injected init container of a Deployment, run in a pod netns as
    the container runs, leaves the capture that ``redirect check`` finds equal to the annotations'
    config (and logs JSON lines with the pod's fields)."""
    annotations = {T + "excludeOutboundPorts": "22", T + "excludeOutboundIPRanges": "10.96.0.0/12",
                   T + "includeInboundPorts": "8080,9090"}
    injected = inject.inject_object(workloads(annotations)[1], inject.InjectOptions(log_json=True))
    spec = injected["spec"]["template"]["spec"]
    init = spec["initContainers"][0]
    assert init["command"][:3] == ["redirect", "--log-json", "init"]
    p = as_container(init, spec, pod.name, [*init["command"][:2], "-v", *init["command"][2:]])
    try:
        assert p.returncode == 0, p.stderr
        lines = [json.loads(ln) for ln in p.stderr.splitlines()]
        assert lines and all(ln["pod_name"] == "web-0" and ln["pod_namespace"] == "shop" for ln in lines), lines
        res = redirect.check(pod.name, config_from_annotations(annotations))
        assert res.ok, res.differences
        assert not redirect.check(pod.name, config_from_annotations({})).ok  # and not the defaults
    finally:
        redirect.teardown(pod.name)


def test_a_held_pod_starts_as_the_kubelet_would_run_its_injected_commands(pod: Pod) -> None:
    """The injected init command, then the proxy's postStart hook exactly as written (Istio's URL on
    localhost:15020 inside the pod): the hook returns only once the proxy answers, and fails (the
    kubelet would kill the container) when it never does."""
    injected = inject.inject_object(workloads({T + "excludeOutboundPorts": "22"})[0],
                                    inject.InjectOptions(proxy_image="proxy-with-redirect:1", hold_application=True,
                                                         wait_timeout=20))
    spec = injected["spec"]
    init, proxy = spec["initContainers"][0], spec["containers"][0]
    hook = proxy["lifecycle"]["postStart"]["exec"]["command"]
    assert secctx.creds_of(proxy, spec).uid == 1337  # the hook runs as the proxy container runs
    try:
        p = as_container(init, spec, pod.name)
        assert p.returncode == 0, p.stderr
        with health(pod.name, ready_after=1.0, port=15020) as h:
            t0 = time.monotonic()
            p = as_container(proxy, spec, pod.name, hook)
            took = time.monotonic() - t0
        assert p.returncode == 0 and took >= 1.0, (p.stderr, took)
        assert h.answers[-1] == 200 and 503 in h.answers
        short = inject.inject_object(injected, inject.InjectOptions(proxy_image="p:1", hold_application=True,
                                                                    wait_timeout=1))
        with health(pod.name, ready_after=None, port=15020):
            p = as_container(proxy, spec, pod.name, short["spec"]["containers"][0]["lifecycle"]["postStart"]["exec"][
                "command"])
        assert p.returncode == 1 and "503" in p.stderr, p.stderr
    finally:
        redirect.teardown(pod.name)


# --- refused, or left alone ---------------------------------------------------------------------


def _refused(obj: dict[str, Any], opts: inject.InjectOptions | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        inject.inject_object(obj, opts or inject.InjectOptions(proxy_image="envoy:1"))
    return str(e.value)


def test_what_cannot_be_injected_is_refused_naming_the_object_and_field() -> None:
    pod = workloads()[0]
    dep = workloads()[1]
    host = {**dep, "spec": {**dep["spec"], "template": template(hostNetwork=True)}}
    assert "Deployment/web.spec.hostNetwork" in _refused(host) and "node" in _refused(host)
    win = {**pod, "spec": {**pod["spec"], "os": {"name": "windows"}}}
    assert "Pod/web.spec.os.name" in _refused(win)
    istio = {**pod, "spec": {"containers": [APP, {"name": "istio-proxy", "image": "istio/proxyv2"}]}}
    assert "Istio already injected" in _refused(istio)
    taken = {**pod, "spec": {"containers": [APP, {"name": "redirect-proxy", "image": "mine"}]}}
    assert "'redirect-proxy'" in _refused(taken) and "taken" in _refused(taken)
    bad = workloads({T + "excludeOutboundPorts": "22,ssh"})[2]
    msg = _refused(bad)
    assert "StatefulSet/db" in msg and T + "excludeOutboundPorts" in msg and "22,ssh" in msg
    named = workloads({"sidecar.istio.io/proxyUID": "istio-proxy"})[0]
    assert "proxyUID" in _refused(named) and "number" in _refused(named)
    assert "containers" in _refused({**pod, "spec": {"containers": []}})
    assert "no pod spec" in _refused({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}})
    for bad_opts in (dict(mode="ambient"), dict(hold_application=True), dict(backend="ebpf"),
                     dict(ready_url="https://x/ready"), dict(image="a b")):
        with pytest.raises(ConfigError):
            inject.InjectOptions(**bad_opts)  # type: ignore[arg-type]
    # the CLI: exit 2, the message on stderr, nothing on stdout
    p = run_inject("--proxy-image", "envoy:1", stdin=yaml.safe_dump(host))
    assert p.returncode == 2 and not p.stdout and "hostNetwork" in p.stderr, p.stderr
    p = run_inject("--mode", "ambient", stdin=yaml.safe_dump(pod))
    assert p.returncode == 2 and "node agent" in p.stderr, p.stderr
    p = run_inject(stdin="kind: [unclosed")
    assert p.returncode == 2 and "YAML" in p.stderr, p.stderr
    p = run_inject(stdin="just a string\n")
    assert p.returncode == 2 and "not a Kubernetes object" in p.stderr, p.stderr


def test_pods_that_opt_out_are_left_as_they_are() -> None:
    for opt_out in ({"sidecar.istio.io/inject": "false"}, {"sidecar.istio.io/interceptionMode": "NONE"}):
        objs = workloads(opt_out)
        stream = yaml.safe_dump_all(objs, sort_keys=False)
        p = run_inject("--proxy-image", "envoy:1", stdin=stream)
        assert p.returncode == 0, p.stderr
        assert list(yaml.safe_load_all(p.stdout)) == objs
        assert p.stderr.count("not injected") == len(objs), p.stderr
