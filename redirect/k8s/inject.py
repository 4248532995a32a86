"""``redirect inject``: add sidecar capture to pod specs, offline (Istio's ``istioctl kube-inject``).

Reads a YAML (or JSON) stream of Kubernetes objects and writes it back with every pod
template injected; objects without a pod template (Services, ConfigMaps, ...) pass
through unchanged. Pod templates are found in ``Pod`` (``spec``), ``Deployment``,
``StatefulSet``, ``DaemonSet``, ``ReplicaSet``, ``ReplicationController``, ``Job``
(``spec.template.spec``), ``CronJob`` (``spec.jobTemplate.spec.template.spec``) and the
items of a ``List``. Each pod gets:

- an init container ``redirect-init`` (first of the init containers) running
  ``redirect init`` with the ``istio-iptables`` flags that the pod's Istio annotations
  mean (``traffic.sidecar.istio.io/*``, ``sidecar.istio.io/interceptionMode``,
  ``sidecar.istio.io/proxyUID``/``proxyGID``; parsed by ``redirect.istio.annotations``), as
  root with ``NET_ADMIN`` and ``NET_RAW`` and every other capability dropped: the only
  container with them. An init container that fails keeps the pod from starting, so the
  app never runs uncaptured;
- with ``proxy_image``, a proxy container ``redirect-proxy`` running as the proxy
  uid/gid (1337 unless annotated), non-root, no privilege escalation, every capability
  dropped. Under ``TPROXY`` interception it runs as root in the proxy's group with
  ``NET_ADMIN`` alone, as Istio's template has it: transparent sockets need that capability
  in effect, which a runtime gives to root only, and the capture leaves the proxy's traffic
  alone by its group. Appended after the app's containers; with
  ``hold_application`` it comes first instead, with a ``postStart`` hook ``redirect wait
  --url ...``: the kubelet starts the next container only once the hook returns, so the
  app starts once its proxy is ready (Istio's ``holdApplicationUntilProxyStarts``; the
  proxy image must then carry ``redirect``, as Istio's carries ``pilot-agent``);
- the annotation ``redirect/inject-status`` recording what was added.

Injecting is idempotent: a pod that carries ``redirect/inject-status`` has what it records
removed, then is injected again, so injecting twice gives the same output, and injecting
with other options replaces the earlier injection. Pods that opt out
(``sidecar.istio.io/inject: "false"``, interception ``NONE``) are left as they are. What
can't be injected is refused with ``ConfigError`` naming the object and the field:
``hostNetwork`` pods (capture would go into the node's netns), Windows pods, pods
Istio already injected, container names we need that are taken, bad annotations,
non-numeric proxy ids (a ``runAsUser`` is a number).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..config import RedirectConfig
from ..errors import ConfigError
from ..istio.annotations import INJECTED, PROXY_GID, PROXY_UID, config_from_annotations, wants_capture
from ..istio.flags import BOOL_FLAGS, STRING_FLAGS, config_from_istio_args

DEFAULT_IMAGE = "redirect:0.1.0"
INIT_NAME = "redirect-init"
PROXY_NAME = "redirect-proxy"
STATUS = INJECTED
READY_URL = "http://localhost:15020/healthz/ready"
#: Backends ``redirect init`` can be told to use from its istio-iptables flags.
BACKENDS = {"iptables": [], "iptables-legacy": ["--force-iptables-binary", "iptables-legacy"],
            "iptables-nft": ["--force-iptables-binary", "iptables-nft"], "nftables": ["--native-nftables"]}
#: Kinds whose pod template lives at ``spec.template``.
TEMPLATE_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "ReplicationController", "Job")
MAX_INPUT = 16 << 20  # bytes
_ISTIO_CONTAINERS = ("istio-init", "istio-proxy", "istio-validation")
_NUMERIC_ID = re.compile(r"^[0-9]{1,10}(-[0-9]{1,10})?$")


@dataclass(frozen=True)
class InjectOptions:
    """How to inject (``redirect inject``'s flags)."""

    image: str = DEFAULT_IMAGE
    proxy_image: str | None = None
    hold_application: bool = False
    backend: str = "iptables"
    ready_url: str = READY_URL
    wait_timeout: float = 60.0
    log_json: bool = False
    mode: str = "sidecar"

    def __post_init__(self) -> None:
        if self.mode != "sidecar":
            raise ConfigError("--mode", self.mode, "only sidecar pods are injected; ambient pods are captured "
                                                   "by the node agent (deploy/), with nothing in the pod spec")
        if self.backend not in BACKENDS:
            raise ConfigError("--backend", self.backend, f"expected one of {', '.join(BACKENDS)} "
                                                         "(the ones `redirect init` can run in a pod)")
        for name, image in (("--image", self.image), ("--proxy-image", self.proxy_image)):
            if image is not None and (not image or any(c.isspace() for c in image)):
                raise ConfigError(name, image, "expected a container image reference")
        if self.hold_application and self.proxy_image is None:
            raise ConfigError("--hold-application", True, "needs --proxy-image: it holds the app until that "
                                                          "proxy container is ready")
        if not 0 < self.wait_timeout <= 3600:
            raise ConfigError("--wait-timeout", self.wait_timeout, "expected seconds in (0, 3600]")
        from ..wait import parse_url

        parse_url(self.ready_url)


# --- config -> istio-iptables flags ---------------------------------------------------------------


def _flag_value(value: Any) -> str:
    if value == "*":
        return "*"
    if isinstance(value, tuple):
        return ",".join(f"{v[0]}-{v[1]}" if isinstance(v, tuple) else str(v) for v in value)
    return str(value)


def init_args(cfg: RedirectConfig, backend: str = "iptables") -> list[str]:
    """The ``redirect init`` (``istio-iptables``) flags that give exactly ``cfg``.

    Every flag is written, so the result does not depend on the image's environment
    variables. Raises ``ConfigError`` when ``cfg`` sets something no flag expresses.
    """
    out: list[str] = []
    for short, long, field, _default, _help in STRING_FLAGS:
        if field is not None:
            out += [short or long, _flag_value(getattr(cfg, field))]
    for long, field, _env, _help in BOOL_FLAGS:
        if field is not None and getattr(cfg, field):
            out.append(long)
    out += BACKENDS[backend]
    back = config_from_istio_args(out, env={})
    if back != cfg:
        diff = [f.name for f in cfg.__dataclass_fields__.values() if getattr(cfg, f.name) != getattr(back, f.name)]
        raise ConfigError(diff[0], getattr(cfg, diff[0]), "no istio-iptables flag sets it: cannot be injected")
    return out


# --- pod templates -----------------------------------------------------------------------------


def _get(obj: Any, path: Iterable[str]) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _pod_template_paths(doc: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(path of the pod spec, path of the pod's metadata) in ``doc``, or None for kinds without pods."""
    kind = doc.get("kind")
    if kind == "Pod":
        return ("spec",), ("metadata",)
    if kind in TEMPLATE_KINDS:
        return ("spec", "template", "spec"), ("spec", "template", "metadata")
    if kind == "CronJob":
        base = ("spec", "jobTemplate", "spec", "template")
        return (*base, "spec"), (*base, "metadata")
    return None


def _name(doc: Mapping[str, Any]) -> str:
    meta = doc.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    return f"{doc.get('kind')}/{meta.get('name') or meta.get('generateName') or '?'}"


def _containers(spec: dict[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    items = spec.get(key)
    if items is None:
        return []
    if not isinstance(items, list) or not all(isinstance(c, dict) for c in items):
        raise ConfigError(f"{where}.{key}", items, "expected a list of containers")
    return items


def _strip(spec: dict[str, Any], meta: dict[str, Any], where: str) -> None:
    """Remove what an earlier injection recorded in ``redirect/inject-status``."""
    annotations = meta.get("annotations") or {}
    raw = annotations.get(STATUS)
    if raw is None:
        return
    try:
        status = json.loads(raw)
        init_names, names = list(status["initContainers"]), list(status["containers"])
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"{where} annotation {STATUS}", raw, f"not what redirect inject writes ({e})") from None
    for key, drop in (("initContainers", init_names), ("containers", names)):
        kept = [c for c in _containers(spec, key, where) if c.get("name") not in drop]
        if kept or key == "containers":
            spec[key] = kept
        else:
            spec.pop(key, None)
    del annotations[STATUS]  # an emptied mapping stays, so re-adding keeps its place in the text


def _proxy_id(cfg_ids: tuple[Any, ...], annotation: str, annotations: Mapping[str, Any], where: str) -> int:
    raw = annotations.get(annotation)
    if raw is not None and not (isinstance(raw, str) and all(_NUMERIC_ID.match(p.strip()) for p in raw.split(","))):
        raise ConfigError(f"{where} annotation {annotation}", raw,
                          "the proxy container's runAsUser/runAsGroup is a number: expected numeric ids")
    first = cfg_ids[0]
    return first[0] if isinstance(first, tuple) else int(first)


def _downward_env() -> list[dict[str, Any]]:
    return [{"name": var, "valueFrom": {"fieldRef": {"fieldPath": path}}}
            for var, path in (("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace"),
                              ("POD_UID", "metadata.uid"))]


def inject_pod(spec: dict[str, Any], meta: dict[str, Any], opts: InjectOptions, where: str) -> bool:
    """Inject one pod spec in place (``meta`` is its metadata); False when the pod opts out."""
    _strip(spec, meta, where)
    annotations = meta.get("annotations") or {}
    if not isinstance(annotations, dict):
        raise ConfigError(f"{where}.metadata.annotations", annotations, "expected a mapping")
    if not wants_capture(annotations):
        return False
    if spec.get("hostNetwork") is True:
        raise ConfigError(f"{where}.spec.hostNetwork", True,
                          "the pod uses the node's network namespace: capture would be installed there")
    if _get(spec, ("os", "name")) == "windows":
        raise ConfigError(f"{where}.spec.os.name", "windows", "capture needs a Linux pod")
    inits = _containers(spec, "initContainers", where)
    containers = _containers(spec, "containers", where)
    if not containers:
        raise ConfigError(f"{where}.spec.containers", spec.get("containers"), "a pod needs at least one container")
    for c in inits + containers:
        if c.get("name") in _ISTIO_CONTAINERS:
            raise ConfigError(f"{where} container", c.get("name"), "Istio already injected this pod")
        if c.get("name") in (INIT_NAME, PROXY_NAME):
            raise ConfigError(f"{where} container", c.get("name"), "the name is taken by a container that "
                                                                   f"redirect inject did not add (no {STATUS})")
    try:
        cfg = config_from_annotations(annotations)
    except ConfigError as e:
        raise ConfigError(f"{where} annotation {e.field}", e.value, e.reason) from None
    uid = _proxy_id(cfg.proxy_uids, PROXY_UID, annotations, where)
    gid = _proxy_id(cfg.proxy_gids, PROXY_GID, annotations, where)

    log = ["--log-json"] if opts.log_json else []
    init = {
        "name": INIT_NAME,
        "image": opts.image,
        "command": ["redirect", *log, "init", *init_args(cfg, opts.backend)],
        "env": _downward_env(),
        "securityContext": {
            "runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False, "privileged": False,
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False,
            "capabilities": {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]},
        },
    }
    spec["initContainers"] = [init, *inits]
    added = []
    if opts.proxy_image is not None:
        caps: dict[str, Any] = {"drop": ["ALL"]}
        user = uid
        if cfg.inbound_interception == "TPROXY":
            # IP_TRANSPARENT sockets need CAP_NET_ADMIN in effect, and a runtime puts added
            # capabilities in effect for root only: root, in the proxy's group (the capture's -g).
            caps["add"] = ["NET_ADMIN"]
            user = 0
        proxy: dict[str, Any] = {
            "name": PROXY_NAME,
            "image": opts.proxy_image,
            "securityContext": {
                "runAsUser": user, "runAsGroup": gid, "runAsNonRoot": user != 0, "privileged": False,
                "allowPrivilegeEscalation": False, "capabilities": caps,
            },
        }
        if opts.hold_application:
            proxy["lifecycle"] = {"postStart": {"exec": {"command": [
                "redirect", *log, "wait", "--url", opts.ready_url, "--timeout", f"{opts.wait_timeout:g}"]}}}
            spec["containers"] = [proxy, *containers]
        else:
            spec["containers"] = [*containers, proxy]
        added.append(PROXY_NAME)
    status = {"initContainers": [INIT_NAME], "containers": added}
    meta.setdefault("annotations", {})
    if not isinstance(meta["annotations"], dict):
        meta["annotations"] = {}
    meta["annotations"][STATUS] = json.dumps(status, sort_keys=True, separators=(",", ":"))
    return True


def inject_object(doc: Any, opts: InjectOptions, notes: list[str] | None = None) -> Any:
    """A copy of one Kubernetes object with its pod template injected (unchanged when it has none)."""
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise ConfigError("document", str(doc)[:60], "not a Kubernetes object (a mapping with kind)")
    if not isinstance(doc.get("kind"), str):
        raise ConfigError("document kind", doc.get("kind"), "not a Kubernetes object (a mapping with kind)")
    out = copy.deepcopy(doc)
    if doc["kind"] == "List":
        items = out.get("items")
        if not isinstance(items, list):
            raise ConfigError(f"{_name(doc)}.items", items, "expected a list of objects")
        out["items"] = [inject_object(item, opts, notes) for item in items]
        return out
    paths = _pod_template_paths(out)
    if paths is None:
        return out
    spec_path, meta_path = paths
    where = _name(doc)
    parent = _get(out, spec_path[:-1])
    spec = _get(out, spec_path)
    if not isinstance(parent, dict) or not isinstance(spec, dict):
        raise ConfigError(f"{where}.{'.'.join(spec_path)}", spec, "missing: no pod spec to inject")
    meta_parent = _get(out, meta_path[:-1])
    if not isinstance(meta_parent, dict):
        raise ConfigError(f"{where}.{'.'.join(meta_path[:-1])}", meta_parent, "expected a mapping")
    meta = meta_parent.setdefault(meta_path[-1], {})
    if meta is None:
        meta = meta_parent[meta_path[-1]] = {}
    if not isinstance(meta, dict):
        raise ConfigError(f"{where}.{'.'.join(meta_path)}", meta, "expected a mapping")
    if not inject_pod(spec, meta, opts, where) and notes is not None:
        notes.append(f"{where}: not injected (the pod opts out of capture by annotation)")
    if not meta:
        del meta_parent[meta_path[-1]]
    return out


# --- streams -----------------------------------------------------------------------------------


def load_stream(text: str) -> tuple[list[Any], bool]:
    """The objects of a YAML stream (or one JSON document); (objects, was JSON)."""
    import yaml

    if len(text.encode("utf-8", "surrogatepass")) > MAX_INPUT:
        raise ConfigError("input", f"{len(text)} characters", f"larger than {MAX_INPUT >> 20} MiB")
    if text.lstrip().startswith(("{", "[")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError("input", text[:60], f"not valid JSON: {e}") from None
        return (data if isinstance(data, list) else [data]), True
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None], False
    except yaml.YAMLError as e:
        raise ConfigError("input", text[:60], f"not valid YAML: {e}") from None


def dump_stream(objects: list[Any], as_json: bool) -> str:
    import yaml

    if as_json:
        body = objects[0] if len(objects) == 1 else {"apiVersion": "v1", "kind": "List", "items": objects}
        return json.dumps(body, indent=2) + "\n"
    return yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False, explicit_start=True)


def inject_text(text: str, opts: InjectOptions, notes: list[str] | None = None) -> str:
    """``text`` (a YAML stream or JSON) with every pod template injected, in the same format."""
    objects, as_json = load_stream(text)
    return dump_stream([inject_object(o, opts, notes) for o in objects], as_json)


__all__ = ["InjectOptions", "inject_object", "inject_pod", "inject_text", "init_args", "load_stream",
           "DEFAULT_IMAGE", "INIT_NAME", "PROXY_NAME", "STATUS"]
