"""A kubelet's part, for the CRI tests: a Kubernetes Pod object run on a node (``tests.crikit.Node``)
through the CRI calls a kubelet makes, with the translations a kubelet does.

- the pod sandbox (``RunPodSandbox``): metadata (name, namespace, uid), labels, annotations (which
  the CRI plugin hands to CNI as ``io.kubernetes.cri.pod-annotations``), the namespaces
  (``hostNetwork``/``hostPID``/``hostIPC``), the pod's cgroup parent, privileged when any
  container is, seccomp ``RuntimeDefault`` (the kubelet's choice for sandboxes), the hostname
  only when the pod has its own network;
- each container (``CreateContainer``/``StartContainer``): the image as the node has it
  (``ImageStatus``, the reference normalised as Kubernetes does; nothing is pulled: a missing
  image fails as ``ErrImageNeverPull`` would), ``command``/``args`` with ``$(VAR)`` expanded,
  ``env`` (values, downward-API fields, ConfigMap keys), ``volumeMounts`` (hostPath volumes with
  their ``type`` checked or created on the node, ConfigMap volumes as read-only directories of
  their keys, emptyDir, ``mountPropagation``), and the security context as the kubelet
  synthesises it (``determineEffectiveSecurityContext``): the container's over the pod's,
  capabilities add/drop passed as written (the runtime applies them to its default set),
  ``runAsUser``/``runAsGroup``, ``privileged``, ``readOnlyRootFilesystem``, ``no_new_privs``
  from ``allowPrivilegeEscalation: false``, the default masked and read-only /proc paths,
  seccomp ``Unconfined`` unless a profile is given (the kubelet's default without
  ``--seccomp-default``), ``runAsNonRoot`` checked against the user;
- init containers one after the other, each to a zero exit, before the containers; the
  containers in order, each ``postStart`` exec hook run (``ExecSync``) before the next starts;
- probes: ``httpGet`` from the node's netns (what the kubelet's prober reaches);
- stop: ``StopContainer`` with the pod's grace period, ``StopPodSandbox``, ``RemovePodSandbox``.

What a kubelet does that is not here: image pulls, restarts and back-off, the managed
``/etc/hosts`` and ``/dev/termination-log`` mounts, service environment variables, resources.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import netkit

#: The kubelet's default masked and read-only paths (``procMount: Default``).
MASKED_PATHS = ["/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware",
                "/sys/devices/virtual/powercap"]
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion of a command argument (``$$`` is a literal ``$``)."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


def container_env(c: dict[str, Any], fields: dict[str, str], config_maps: dict[str, dict[str, str]]) -> dict[str, str]:
    """A container's environment: literal values (``$(VAR)`` of earlier ones expanded), downward-API
    fields (``fields``: fieldPath -> value), ConfigMap keys."""
    out: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = expand(e["value"], out)
        elif "fieldRef" in e.get("valueFrom", {}):
            out[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = e["valueFrom"]["configMapKeyRef"]
            out[e["name"]] = config_maps[ref["name"]][ref["key"]]
    return out


def argv_of(c: dict[str, Any], env: dict[str, str]) -> tuple[list[str], list[str]]:
    """(command, args) as the runtime gets them."""
    return [expand(a, env) for a in c.get("command", [])], [expand(a, env) for a in c.get("args", [])]


def http_probe(netns: str, probe: dict[str, Any], pod_ip: str) -> int:
    """A probe's ``httpGet``, sent from ``netns`` as the kubelet's prober sends it (to ``host``, else
    the pod's IP); the HTTP status (0: no answer)."""
    g = probe["httpGet"]
    url = f"{g.get('scheme', 'HTTP').lower()}://{g.get('host') or pod_ip}:{g['port']}{g['path']}"

    def get() -> int:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            return 0

    return netkit.in_netns(netns, get)


class PodFailed(AssertionError):
    """The pod did not start as a kubelet would have it (init container failed, hook failed, ...)."""


@dataclass
class PodRun:
    """A pod on the node: its sandbox, its containers' ids, where its logs are."""

    pod: dict[str, Any]
    uid: str
    sandbox_id: str
    config: Any  # the PodSandboxConfig
    log_dir: Path
    ip: str
    pid: int  # the sandbox's process: /proc/<pid>/ns/net is the pod's netns
    pin: str  # where the runtime pinned the pod's netns (CNI_NETNS), on the node; "" with hostNetwork
    containers: dict[str, str] = field(default_factory=dict)  # name -> container id (init containers too)

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"].get("namespace", "default"))

    @property
    def spec(self) -> dict[str, Any]:
        return dict(self.pod["spec"])

    @property
    def netns(self) -> str:
        return f"/proc/{self.pid}/ns/net"

    def container(self, name: str) -> dict[str, Any]:
        (c,) = [c for c in [*self.spec.get("initContainers", []), *self.spec["containers"]] if c["name"] == name]
        return dict(c)


class Kubelet:
    """Runs pods on ``node`` (a ``tests.crikit.Node``) through its CRI. ``config_maps``: name -> data,
    the ConfigMaps pods may mount or read."""

    def __init__(self, node: Any, config_maps: dict[str, dict[str, str]] | None = None) -> None:
        self.node = node
        self.cri = node.cri
        self.pb = node.cri.pb
        self.config_maps = config_maps or {}

    # --- translations -------------------------------------------------------------------------

    def namespace_options(self, spec: dict[str, Any]) -> Any:
        pb = self.pb
        return pb.NamespaceOption(
            network=pb.NODE if spec.get("hostNetwork") else pb.POD,
            pid=pb.NODE if spec.get("hostPID") else (pb.POD if spec.get("shareProcessNamespace") else pb.CONTAINER),
            ipc=pb.NODE if spec.get("hostIPC") else pb.POD)

    def sandbox_config(self, pod: dict[str, Any], uid: str) -> Any:
        pb = self.pb
        meta, spec = pod["metadata"], pod["spec"]
        name, namespace = meta["name"], meta.get("namespace", "default")
        containers = [*spec.get("initContainers", []), *spec["containers"]]
        psc = spec.get("securityContext") or {}
        sc = pb.LinuxSandboxSecurityContext(
            namespace_options=self.namespace_options(spec),
            privileged=any((c.get("securityContext") or {}).get("privileged") for c in containers),
            seccomp=pb.SecurityProfile(profile_type=pb.SecurityProfile.RuntimeDefault),
            supplemental_groups=list(psc.get("supplementalGroups", [])))
        if "runAsUser" in psc:
            sc.run_as_user.value = psc["runAsUser"]
        if "runAsGroup" in psc:
            sc.run_as_group.value = psc["runAsGroup"]
        labels = {**meta.get("labels", {}), "io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace,
                  "io.kubernetes.pod.uid": uid}
        return pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, namespace=namespace, uid=uid, attempt=0),
            hostname="" if spec.get("hostNetwork") else name,
            log_directory=str(self.node.base / "pods" / f"{namespace}_{name}_{uid}"),
            labels=labels, annotations=dict(meta.get("annotations") or {}),
            linux=pb.LinuxPodSandboxConfig(cgroup_parent=f"{self.node.cgroup_parent}/pod{uid}", security_context=sc))

    def security_context(self, spec: dict[str, Any], c: dict[str, Any]) -> Any:
        pb = self.pb
        psc = spec.get("securityContext") or {}
        csc = c.get("securityContext") or {}
        eff = {k: v for k, v in psc.items() if k in ("runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile")}
        eff.update(csc)
        caps = eff.get("capabilities") or {}
        sc = pb.LinuxContainerSecurityContext(
            capabilities=pb.Capability(add_capabilities=caps.get("add", []), drop_capabilities=caps.get("drop", [])),
            privileged=bool(eff.get("privileged", False)),
            readonly_rootfs=bool(eff.get("readOnlyRootFilesystem", False)),
            namespace_options=self.namespace_options(spec),
            supplemental_groups=list(psc.get("supplementalGroups", [])),
            no_new_privs=eff.get("allowPrivilegeEscalation") is False,
            masked_paths=[] if eff.get("procMount") == "Unmasked" else MASKED_PATHS,
            readonly_paths=[] if eff.get("procMount") == "Unmasked" else READONLY_PATHS)
        profile = (eff.get("seccompProfile") or {}).get("type")
        sc.seccomp.profile_type = pb.SecurityProfile.RuntimeDefault if profile == "RuntimeDefault" else \
            pb.SecurityProfile.Unconfined
        if "runAsUser" in eff:
            sc.run_as_user.value = eff["runAsUser"]
        if "runAsGroup" in eff:
            sc.run_as_group.value = eff["runAsGroup"]
        if "fsGroup" in psc:
            sc.supplemental_groups.append(psc["fsGroup"])
        return sc

    def _volume_source(self, run: PodRun, volume: dict[str, Any]) -> tuple[str, bool]:
        """(path on the node, read-only) of a pod volume; hostPath types checked or created as the kubelet does."""
        if "hostPath" in volume:
            path, kind = volume["hostPath"]["path"], volume["hostPath"].get("type", "")
            seen = self.node.view(path)
            if kind == "DirectoryOrCreate":
                seen.mkdir(parents=True, exist_ok=True)
            elif kind == "FileOrCreate" and not seen.exists():
                seen.parent.mkdir(parents=True, exist_ok=True)
                seen.touch()
            elif kind in ("Directory", "File", "Socket") and not (seen.is_dir() if kind == "Directory"
                                                                   else seen.exists()):
                raise PodFailed(f"hostPath {path} ({kind}) does not exist on the node")
            return self.node.host_path(path), False
        where = self.node.base / "pods" / run.uid / "volumes" / volume["name"]
        if "configMap" in volume:
            if not where.exists():
                where.mkdir(parents=True)
                for key, value in self.config_maps[volume["configMap"]["name"]].items():
                    (where / key).write_text(value)
            return str(where), True
        if "emptyDir" in volume:
            where.mkdir(parents=True, exist_ok=True)
            where.chmod(0o777)
            return str(where), False
        raise PodFailed(f"volume {volume['name']}: kind not supported by the test's kubelet")

    def mounts(self, run: PodRun, c: dict[str, Any]) -> list[Any]:
        pb = self.pb
        volumes = {v["name"]: v for v in run.spec.get("volumes", [])}
        propagation = {None: pb.PROPAGATION_PRIVATE, "None": pb.PROPAGATION_PRIVATE,
                       "HostToContainer": pb.PROPAGATION_HOST_TO_CONTAINER,
                       "Bidirectional": pb.PROPAGATION_BIDIRECTIONAL}
        out = []
        for m in c.get("volumeMounts", []):
            path, ro = self._volume_source(run, volumes[m["name"]])
            out.append(pb.Mount(container_path=m["mountPath"], host_path=path, readonly=ro or bool(m.get("readOnly")),
                                propagation=propagation[m.get("mountPropagation")]))
        return out

    def image_id(self, image: str) -> str:
        from tests.crikit import full_name

        st = self.cri.images.ImageStatus(self.pb.ImageStatusRequest(image=self.pb.ImageSpec(image=full_name(image))),
                                         timeout=10)
        if not st.image.id:
            raise PodFailed(f"ErrImageNeverPull: image {image!r} is not on the node (nothing is pulled here)")
        return str(st.image.id)

    def fields(self, run: PodRun) -> dict[str, str]:
        return {"metadata.name": run.name, "metadata.namespace": run.namespace, "metadata.uid": run.uid,
                "spec.nodeName": self.node.name, "status.podIP": run.ip, "status.hostIP": self.node.gateway,
                "spec.serviceAccountName": run.spec.get("serviceAccountName", "default")}

    def container_config(self, run: PodRun, c: dict[str, Any]) -> Any:
        pb = self.pb
        env = container_env(c, self.fields(run), self.config_maps)
        command, args = argv_of(c, env)
        sc = self.security_context(run.spec, c)
        if (c.get("securityContext") or {}).get("runAsNonRoot", (run.spec.get("securityContext") or {})
                                                  .get("runAsNonRoot")) and sc.run_as_user.value == 0:
            raise PodFailed(f"container {c['name']}: runAsNonRoot and the container would run as root")
        return pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=c["name"], attempt=0),
            image=pb.ImageSpec(image=self.image_id(c["image"])),
            command=command, args=args, working_dir=c.get("workingDir", ""),
            envs=[pb.KeyValue(key=k, value=v) for k, v in env.items()],
            mounts=self.mounts(run, c),
            labels={"io.kubernetes.container.name": c["name"], "io.kubernetes.pod.name": run.name,
                    "io.kubernetes.pod.namespace": run.namespace, "io.kubernetes.pod.uid": run.uid},
            log_path=f"{c['name']}/0.log",
            linux=pb.LinuxContainerConfig(security_context=sc))

    # --- the pod's lifecycle --------------------------------------------------------------------

    def sandbox(self, pod: dict[str, Any]) -> PodRun:
        """``RunPodSandbox`` (the CNI ADD happens here); raises the runtime's error (``grpc.RpcError``)."""
        uid = str(pod["metadata"].get("uid") or uuid.uuid4())
        config = self.sandbox_config(pod, uid)
        sid = self.cri.runtime.RunPodSandbox(self.pb.RunPodSandboxRequest(config=config), timeout=120).pod_sandbox_id
        st = self.cri.runtime.PodSandboxStatus(self.pb.PodSandboxStatusRequest(pod_sandbox_id=sid, verbose=True),
                                               timeout=10)
        info = json.loads(st.info.get("info", "{}"))
        namespaces = info.get("runtimeSpec", {}).get("linux", {}).get("namespaces", [])
        pin = next((n.get("path", "") for n in namespaces if n.get("type") == "network"), "")
        return PodRun(pod, uid, sid, config, Path(config.log_directory), st.status.network.ip, int(info["pid"]), pin)

    def create_and_start(self, run: PodRun, name: str) -> str:
        c = run.container(name)
        cid = self.cri.runtime.CreateContainer(self.pb.CreateContainerRequest(
            pod_sandbox_id=run.sandbox_id, config=self.container_config(run, c), sandbox_config=run.config),
            timeout=60).container_id
        run.containers[name] = cid
        self.cri.runtime.StartContainer(self.pb.StartContainerRequest(container_id=cid), timeout=60)
        return str(cid)

    def status(self, run: PodRun, name: str) -> Any:
        return self.cri.runtime.ContainerStatus(self.pb.ContainerStatusRequest(container_id=run.containers[name]),
                                                timeout=10).status

    def logs(self, run: PodRun, name: str) -> str:
        from tests.crikit import cri_log

        return cri_log(run.log_dir / f"{name}/0.log")

    def run_init_containers(self, run: PodRun, timeout: float = 120) -> None:
        """Each init container to its exit; a non-zero exit raises ``PodFailed`` (the pod would stay
        ``Init:Error``) with the container's log."""
        for c in run.spec.get("initContainers", []):
            self.create_and_start(run, c["name"])
            self.wait_init_done(run, c["name"], timeout)

    def wait_init_done(self, run: PodRun, name: str, timeout: float = 120) -> None:
        """Until the started init container ``name`` exits; non-zero raises ``PodFailed`` with its log."""
        deadline = time.monotonic() + timeout
        while (st := self.status(run, name)).state != self.pb.CONTAINER_EXITED:
            if time.monotonic() > deadline:
                raise PodFailed(f"init container {name} still running after {timeout} s:"
                                f" {self.logs(run, name)[-2000:]}")
            time.sleep(0.05)
        if st.exit_code != 0:
            raise PodFailed(f"init container {name} exited {st.exit_code} (Init:Error): {self.logs(run, name)[-3000:]}")

    def runtime_spec(self, run: PodRun, name: str) -> dict[str, Any]:
        """The OCI runtime spec the runtime made for container ``name`` (what runc ran it with)."""
        st = self.cri.runtime.ContainerStatus(self.pb.ContainerStatusRequest(container_id=run.containers[name],
                                                                             verbose=True), timeout=10)
        return dict(json.loads(st.info["info"])["runtimeSpec"])

    def post_start(self, run: PodRun, name: str, timeout: float = 90) -> Any:
        """The container's ``postStart`` exec hook, as the kubelet runs it (``ExecSync``); the response."""
        cmd = run.container(name)["lifecycle"]["postStart"]["exec"]["command"]
        return self.exec(run, name, cmd, timeout)

    def exec(self, run: PodRun, name: str, cmd: list[str], timeout: float = 30) -> Any:
        return self.cri.runtime.ExecSync(self.pb.ExecSyncRequest(
            container_id=run.containers[name], cmd=cmd, timeout=int(timeout)), timeout=timeout + 10)

    def start_containers(self, run: PodRun, hooks: bool = True) -> None:
        """The containers in order; a ``postStart`` hook that fails raises ``PodFailed`` (the kubelet
        kills the container), and the next container starts only once the hook returned."""
        for c in run.spec["containers"]:
            self.create_and_start(run, c["name"])
            if hooks and "postStart" in (c.get("lifecycle") or {}):
                r = self.post_start(run, c["name"])
                if r.exit_code != 0:
                    raise PodFailed(f"postStart hook of {c['name']} exited {r.exit_code}: {r.stderr.decode()[-2000:]}")

    def run_pod(self, pod: dict[str, Any]) -> PodRun:
        """The whole start: sandbox, init containers, containers with their hooks. On failure the pod
        is removed and the failure raised."""
        run = self.sandbox(pod)
        try:
            self.run_init_containers(run)
            self.start_containers(run)
        except BaseException:
            self.remove(run)
            raise
        return run

    def remove(self, run: PodRun) -> None:
        grace = int(run.spec.get("terminationGracePeriodSeconds", 30))
        for name, cid in reversed(run.containers.items()):
            if self.status(run, name).state == self.pb.CONTAINER_RUNNING:
                self.cri.runtime.StopContainer(self.pb.StopContainerRequest(container_id=cid, timeout=grace),
                                               timeout=grace + 30)
        self.cri.runtime.StopPodSandbox(self.pb.StopPodSandboxRequest(pod_sandbox_id=run.sandbox_id), timeout=60)
        self.cri.runtime.RemovePodSandbox(self.pb.RemovePodSandboxRequest(pod_sandbox_id=run.sandbox_id), timeout=60)

    # --- probes ---------------------------------------------------------------------------------

    def probe(self, run: PodRun, name: str, kind: str) -> int:
        """A container's ``httpGet`` probe (``kind``: livenessProbe, readinessProbe, startupProbe), sent
        from the node's netns as the kubelet's prober sends it; the HTTP status (0: no answer)."""
        return http_probe(self.node.name, run.container(name)[kind], run.ip)

    def wait_ready(self, run: PodRun, name: str, timeout: float = 60) -> None:
        """Until the container's readiness probe succeeds (200-399); fails if the container exits."""
        deadline = time.monotonic() + timeout
        while not 200 <= self.probe(run, name, "readinessProbe") < 400:
            st = self.status(run, name)
            if st.state != self.pb.CONTAINER_RUNNING:
                raise PodFailed(f"container {name} exited {st.exit_code}: {self.logs(run, name)[-3000:]}")
            if time.monotonic() > deadline:
                raise PodFailed(f"container {name} not ready after {timeout} s: {self.logs(run, name)[-3000:]}")
            time.sleep(0.1)
