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
from tests.netkit import Pod
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
        assert (sc["runAsUser"], sc["runAsGroup"], sc["runAsNonRoot"], sc["allowPrivilegeEscalation"]) == \
            (1337, 1337, True, False)
        assert sc["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}  # TPROXY: transparent sockets
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
    assert (proxy["runAsUser"], proxy["runAsGroup"]) == (want.proxy_uids[0], want.proxy_gids[0])


def test_the_injected_init_command_installs_what_the_annotations_mean(pod: Pod) -> None:
    """The exact command line of the injected init container, run in a pod netns (as root, as the
    container runs), leaves the capture that ``redirect check`` finds equal to the annotations' config."""
    annotations = {T + "excludeOutboundPorts": "22", T + "excludeOutboundIPRanges": "10.96.0.0/12",
                   T + "includeInboundPorts": "8080,9090"}
    injected = inject.inject_object(workloads(annotations)[1], inject.InjectOptions(log_json=True))
    command = injected["spec"]["template"]["spec"]["initContainers"][0]["command"]
    assert command[:3] == ["redirect", "--log-json", "init"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ISTIO_", "REDIRECT_", "ENVOY_", "INVALID_"))}
    env.update(POD_NAME="web-0", POD_NAMESPACE="shop")
    p = subprocess.run(["ip", "netns", "exec", pod.name, sys.executable, "-m", "redirect.cli", *command[1:]],
                       capture_output=True, text=True, timeout=60, env=env)
    try:
        assert p.returncode == 0, p.stderr
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
    hook = spec["containers"][0]["lifecycle"]["postStart"]["exec"]["command"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ISTIO_", "REDIRECT_", "ENVOY_", "INVALID_"))}
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{env.get('PATH', '/usr/bin:/bin')}"  # redirect on PATH

    def run(command: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", pod.name, *command], capture_output=True, text=True,
                              timeout=60, env=env)

    try:
        p = run(spec["initContainers"][0]["command"])
        assert p.returncode == 0, p.stderr
        with health(pod.name, ready_after=1.0, port=15020) as h:
            t0 = time.monotonic()
            p = run(hook)
            took = time.monotonic() - t0
        assert p.returncode == 0 and took >= 1.0, (p.stderr, took)
        assert h.answers[-1] == 200 and 503 in h.answers
        short = inject.inject_object(injected, inject.InjectOptions(proxy_image="p:1", hold_application=True,
                                                                    wait_timeout=1))
        with health(pod.name, ready_after=None, port=15020):
            p = run(short["spec"]["containers"][0]["lifecycle"]["postStart"]["exec"]["command"])
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
