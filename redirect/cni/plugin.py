"""``redirect-cni``: a chained CNI plugin that installs capture in the pod's netns.

The container runtime runs it after the primary plugin (bridge, Calico, ...), as
CNI spec 1.0.0/1.1.0 says, with ``CNI_COMMAND`` in the environment and the network
config on stdin. Run without ``CNI_COMMAND`` it is the installer
(``redirect-cni install|uninstall``, see ``redirect.cni.install``).

This module's ``run`` is the plugin, whoever runs it: this process (the ``redirect-cni``
console script, or ``redirect-cni-python`` in a CNI bin dir), or ``redirect-agent`` for the
thin plugin (``native/cni_thin.c``, what ``install`` puts in the bin dir as ``redirect-cni``),
which forwards each request to the agent (``redirect.ambient.agent.cni_requests``). Served by the
agent, ambient pods are enrolled by that agent directly, and log lines go to its log as well
as to ``logFile``.

Commands
--------
``ADD``      resolve the pod's capture config, ``redirect.setup`` it in ``CNI_NETNS``,
             print ``prevResult`` (converted to the config's ``cniVersion``) as our result
             (``netconf.encode_output``; one longer than ``netconf.MAX_OUTPUT`` is error 4, before
             anything is installed).
             Fails closed: any error -> error JSON, non-zero exit, nothing installed.
             Ambient with ``agentSocket``: the pod goes to the node agent (``redirect-agent``),
             which installs the rules and hands the netns to the node proxy; its refusal -> error
             103, no answer (no agent, it went away mid-request, none within ``agentTimeout`` s)
             -> error 11, try again later (docs/agent-protocol.md).
``DEL``      ``redirect.teardown`` in ``CNI_NETNS`` (ours by any backend); succeeds when ``CNI_NETNS`` is empty
             or the namespace is already gone; idempotent; the host's own netns is refused (7), as
             by ADD. Ambient with ``agentSocket``: the agent removes the pod (if it can't be
             reached, the in-pod rules are removed here).
``CHECK``    ``redirect.check`` against the same config ADD used; differences -> error 104.
             Ambient with ``agentSocket``: asks the node agent (enrolled in this netns, rules as
             recorded, a node proxy connected), else 104 (11 if the agent gives no answer).
``STATUS``   the backend's tools (and, for ambient with an agent, its socket) exist.
``GC``       netfilter backends: nothing to collect (all our state lives in pod namespaces and
             dies with them). ``backend: "ebpf"`` (or ``"auto"``, eBPF pinned): removes the host
             map entries of pods whose netns went without a DEL
             (``redirect.backends.ebpf.collect_garbage``); a DEL whose namespace is already gone
             does the same.
``VERSION``  ``{"cniVersion", "supportedVersions"}``.

Config (one entry of the conflist's ``plugins``; a setting left out has the default of
``netconf.DEFAULTS``, and ``redirect-cni install`` writes every one out)::

    {"type": "redirect-cni",
     "backend": "iptables",              # any name redirect.backends.get_backend knows
     "mode": "sidecar",                  # or "ambient"
     "capture": {"outbound_exclude_ports": [22]},   # RedirectConfig fields: the defaults ({})
     "excludeNamespaces": ["kube-system"],          # pods there are never captured (default; [] = none)
     "logLevel": "info", "logFile": "/var/log/redirect-cni.log",   # (default null: no log file)
     "logJson": false,                              # true: JSON lines (redirect.logjson) with the pod's fields
     "agentSocket": "/run/redirect/agent.sock",     # the node agent: ambient pods go to it; the thin
                                                    # plugin sends it every request (its default, also
                                                    # for null); at most 107 bytes
     "agentTimeout": 10,                            # seconds to wait for it (then ADD fails, code 11)
     "agentDown": "tryAgain",                       # thin plugin, no agent: code 11, or "inProcess"
     "capabilities": {"io.kubernetes.cri.pod-annotations": true}}

Per-pod overrides (Istio annotation names, see ``redirect.istio.annotations``) are read,
in this order, later sources overriding earlier ones key by key:

1. ``args.cni.annotations`` in the config: ``{"args": {"cni": {"annotations": {...}}}}``
   (the CNI "args" convention);
2. ``runtimeConfig["io.kubernetes.cri.pod-annotations"]``: what containerd's and
   CRI-O's CRI pass when the plugin declares that capability (the Kubernetes path);
3. ``runtimeConfig.podAnnotations`` (same shape; for runtimes that name it so);
4. ``CNI_ARGS`` key ``REDIRECT_ANNOTATIONS``: a JSON object of string -> string,
   base64url-encoded **without** ``=`` padding (padding is accepted but breaks Go
   plugins that split ``CNI_ARGS`` pairs on every ``=``), e.g.
   ``CNI_ARGS="IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;REDIRECT_ANNOTATIONS=eyJzaWRl..."``.

The pod namespace comes from ``CNI_ARGS`` ``K8S_POD_NAMESPACE``. Each source must
be a mapping of strings to strings; a bad source or a bad value fails ADD (and
CHECK) with code 101 naming the annotation and the value.

The network config on stdin may be at most ``MAX_STDIN`` (1 MiB); a longer one (whatever the
command, VERSION included), one that is not UTF-8 JSON, one nested too deeply, or a stdin that
cannot be read (closed) is error 6. ``CNI_NETNS`` is resolved the same way by
every command (a bare name is one under ``/run/netns``; a relative path with a ``/`` is error 7).
The ``CNI_*`` variables are checked first (``netconf.check_env``: UTF-8, at most 32 KiB each):
a bad one is error 7, except for DEL, which then succeeds having done nothing.

Error codes: 1 incompatible cniVersion, 4 invalid network config (a malformed ``prevResult``
included), 6 undecodable stdin, 7 invalid environment variables (a ``CNI_NETNS`` naming the host's
own network namespace included, for ADD and DEL), 11 try again later (backend busy; the node
agent gave no answer: none listens, it went away mid-request, or it did not answer in time: as
the thin plugin answers), 50 plugin not available (STATUS); ours: 100 setup failed, 101 bad pod
annotation, 102 backend unavailable, 103 the node agent refused the ambient pod, 104 CHECK found
differences, 105 teardown failed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..ambient.agent.client import AgentTarget

from ..errors import brief, brief_text
from .netconf import (
    COMMANDS,
    E_AMBIENT,
    E_ANNOTATION,
    E_BACKEND,
    E_CHECK,
    E_DECODE,
    E_ENV,
    E_INCOMPATIBLE,
    E_INVALID_CONFIG,
    E_NOT_AVAILABLE,
    E_SETUP,
    E_TEARDOWN,
    E_TRY_AGAIN,
    LATEST,
    MAX_STDIN,
    SUPPORTED_VERSIONS,
    BadEnv,
    CniError,
    PluginConf,
    check_env,
    check_stdin_size,
    check_version,
    convert_result,
    decode_netconf,
    encode_output,
    encode_result,
    parse_cni_args,
    pod_annotations,
    version_tuple,
)

# --- logging -----------------------------------------------------------------------------


_TEXT_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"


def _pod_log_fields(env: Mapping[str, str]) -> dict[str, str]:
    from .. import logjson

    try:
        cni_args = parse_cni_args(env.get("CNI_ARGS", ""))
    except CniError:
        cni_args = {}
    return logjson.pod_fields(pod_name=cni_args.get("K8S_POD_NAME"), pod_namespace=cni_args.get("K8S_POD_NAMESPACE"),
                              pod_uid=cni_args.get("K8S_POD_UID"), container_id=env.get("CNI_CONTAINERID"),
                              netns=env.get("CNI_NETNS"))


class _AgentRequestLog:
    """The plugin's log when the node agent serves the request (the thin plugin): each line goes
    to the agent's log (logger ``redirect.cni``, with the pod's fields) and, when the config
    names a ``logFile``, is appended there as the Python plugin would write it (``logLevel``,
    ``logJson``, the pod's fields), so the node's CNI log reads the same either way."""

    def __init__(self, pc: PluginConf, env: Mapping[str, str]) -> None:
        import logging

        from .. import logjson

        self.log = logging.getLogger("redirect.cni")
        self.pod = _pod_log_fields(env)
        self.path = pc.log_file
        self.level = logging.getLevelName(pc.log_level.upper())
        self.formatter: logging.Formatter = (
            logjson.JsonFormatter(self.pod) if pc.log_json else logjson.TextFormatter(_TEXT_FORMAT, self.pod))

    def _emit(self, level: int, msg: str, args: tuple[Any, ...], exc_info: bool = False) -> None:
        self.log.log(level, msg, *args, exc_info=exc_info, extra={"fields": self.pod})
        if not self.path or level < self.level:
            return
        record = self.log.makeRecord(self.log.name, level, __file__, 0, msg, args,
                                     sys.exc_info() if exc_info else None)
        from .. import logjson

        try:
            with logjson.open_log_file(self.path) as f:  # as the Python plugin opens it: 0600, no symlink
                f.write(self.formatter.format(record) + "\n")
        except OSError:
            pass  # the agent's own log has the line

    def debug(self, msg: str, *args: Any) -> None:
        self._emit(10, msg, args)

    def info(self, msg: str, *args: Any) -> None:
        self._emit(20, msg, args)

    def warning(self, msg: str, *args: Any) -> None:
        self._emit(30, msg, args)

    def error(self, msg: str, *args: Any) -> None:
        self._emit(40, msg, args)

    def exception(self, msg: str, *args: Any) -> None:
        self._emit(40, msg, args, exc_info=True)


def _setup_logging(pc: PluginConf | None, env: Mapping[str, str] | None = None) -> Any:
    """Log to ``logFile`` at ``logLevel`` (else warnings to stderr), as text or (``logJson``) JSON
    lines carrying the pod's fields from ``CNI_ARGS``, ``CNI_CONTAINERID`` and ``CNI_NETNS``."""
    import logging

    from .. import logjson

    root = logging.getLogger("redirect")
    if root.handlers:
        return logging.getLogger("redirect.cni")
    env = {} if env is None else env
    pod = _pod_log_fields(env)
    kw: dict[str, Any] = {"json_lines": bool(pc is not None and pc.log_json), "pod": pod, "text_format": _TEXT_FORMAT}
    problem: OSError | None = None
    if pc is not None and pc.log_file:
        try:
            logjson.setup(path=pc.log_file, level=pc.log_level, **kw)
            return logging.getLogger("redirect.cni")
        except OSError as e:
            problem = e
    logjson.setup(level=logging.WARNING if pc is None or not pc.log_file else pc.log_level, **kw)
    log = logging.getLogger("redirect.cni")
    if problem is not None:
        log.warning("logging to stderr: cannot use the logFile: %s", problem)
    return log


# --- commands --------------------------------------------------------------------------


def _env(name: str, env: Mapping[str, str], required: bool = True) -> str:
    value = env.get(name, "")
    if required and not value:
        raise CniError(E_ENV, f"{name} is not set", f"CNI_COMMAND={env.get('CNI_COMMAND', '')}")
    return value


def _pod_config(pc: PluginConf, env: Mapping[str, str], log: Any) -> Any | None:
    """The pod's RedirectConfig, or None when the pod is not to be captured."""
    from ..errors import ConfigError
    from ..istio.annotations import config_from_annotations, injected, wants_capture

    cni_args = parse_cni_args(env.get("CNI_ARGS", ""))
    pod_ns = cni_args.get("K8S_POD_NAMESPACE", "")
    pod = f"{pod_ns}/{cni_args.get('K8S_POD_NAME', '')}" if pod_ns else env.get("CNI_CONTAINERID", "")
    base = pc.base_config()
    if pod_ns and pod_ns in pc.exclude_namespaces:
        log.info("pod %s: namespace %s is excluded, not captured", pod, pod_ns)
        return None
    annotations = pod_annotations(pc.raw, cni_args)
    try:
        if not wants_capture(annotations):
            log.info("pod %s: opted out by annotation, not captured", pod)
            return None
        if injected(annotations):
            log.info("pod %s: injected by redirect inject (its init container captures it), not captured here", pod)
            return None
        return config_from_annotations(annotations, base)
    except ConfigError as e:
        raise CniError(E_ANNOTATION, f"pod {brief(pod)}: bad annotation {e}", str(e)) from None


def _prev_ips(pc: PluginConf) -> list[str]:
    """The pod's addresses from ``prevResult`` (``ips[].address`` without the prefix length)."""
    out = []
    for ip in (pc.prev_result or {}).get("ips") or []:
        if isinstance(ip, dict) and isinstance(ip.get("address"), str):
            out.append(ip["address"].split("/", 1)[0])
    return out


def _pod_uid(container_id: str, cni_args: Mapping[str, str]) -> str:
    return cni_args.get("K8S_POD_UID") or container_id


def _netns_gone(netns: str) -> bool:
    """True when ``CNI_NETNS`` is empty or names no namespace any more. Resolved as ADD resolves it
    (``redirect.kernel.netns.path_of``: a bare name is one under /run/netns), never against the cwd."""
    if not netns:
        return True
    from ..errors import NetnsError
    from ..kernel.netns import path_of

    try:
        path = path_of(netns)
    except NetnsError:
        return True
    return path is not None and not os.path.exists(path)


def _ambient_add(pc: PluginConf, netns: str, container_id: str, cni_args: Mapping[str, str], cfg: Any,
                 log: Any = None) -> None:
    """Hand an ambient pod to the node agent at ``pc.agent_socket`` and wait for it to confirm.

    The agent installs the in-pod rules, adds the pod to the node's probe sets and
    hands the netns to the node proxy; it answers once the proxy has acked. A refusal fails
    the ADD with code 103 (fail closed: the pod does not start); the agent undoes what it did.
    No answer (no agent, one that went away mid-request, none within ``agentTimeout``
    seconds) fails it with 11, try again later, as the thin plugin answers then: the runtime
    calls DEL and retries. A refused ``CNI_NETNS`` (the host's, another pod's) is code 7, as
    for a sidecar pod.
    """
    from ..ambient.agent.client import NO_ANSWER, AgentError, add_pod

    try:
        res = add_pod(pc.agent or "", uid=_pod_uid(container_id, cni_args), netns=netns,
                      name=cni_args.get("K8S_POD_NAME", ""), namespace=cni_args.get("K8S_POD_NAMESPACE", ""),
                      ips=_prev_ips(pc), annotations=pod_annotations(pc.raw, cni_args), container_id=container_id,
                      config=cfg.to_dict(), backend=pc.backend, timeout=pc.agent_timeout)
    except AgentError as e:
        if e.reason == "netns":  # the host's, another pod's, not a namespace: as a sidecar ADD answers
            raise NetnsRefused(f"CNI_NETNS: the node agent refused it: {e}") from None
        raise CniError(E_TRY_AGAIN if e.reason in NO_ANSWER else E_AMBIENT,
                       f"node agent did not enrol the pod ({e.reason}): {e}",
                       f"agentSocket={pc.agent_socket}") from None
    import logging

    (log or logging.getLogger("redirect.cni")).info("ADD container=%s netns=%s ambient: enrolled by the node agent "
                                                    "in %s ms", container_id, netns, res.get("ms"))


def _ambient_del(pc: PluginConf, env: Mapping[str, str], log: Any) -> None:
    """Tell the node agent the pod is gone. If the agent can't be reached, remove what is in
    the pod netns here (DEL must not fail on a missing agent): the in-pod rules and routes
    (the normal teardown), and the agent's record of that netns on the node, unless the record
    names another pod (then nothing is touched). The rest (node-set entries, the node proxy's
    listeners) is the agent's: when it starts, it drops what belongs to no pod it has a commit
    record of."""
    from ..ambient.agent.client import AgentError, del_pod

    container = env.get("CNI_CONTAINERID", "")
    netns = env.get("CNI_NETNS", "")
    uid = _pod_uid(container, parse_cni_args(env.get("CNI_ARGS", "")))
    try:
        del_pod(pc.agent or "", uid=uid, netns=netns, container_id=container, timeout=pc.agent_timeout)
        log.info("DEL container=%s netns=%r ambient: removed by the node agent", container, netns)
        return
    except AgentError as e:
        if e.reason == "netns":  # refused (the host's netns): not for want of an agent
            raise NetnsRefused(f"CNI_NETNS: the node agent refused it: {e}") from None
        log.warning("DEL container=%s: node agent unavailable (%s); removing in-pod rules directly", container, e)
    if _netns_gone(netns):
        return
    from .. import api
    from ..ambient.agent import legacy, store
    from ..kernel.netns import netns_key

    try:
        key = _redirect_errors(netns_key, netns, code=E_TEARDOWN)
        try:
            rec = _redirect_errors(store.read, key, code=E_TEARDOWN)
        except store.BadRecord as e:
            raise CniError(E_TEARDOWN, f"the node agent's record of this netns: {e}") from None
        if rec is not None and rec.get("uid") != uid:
            log.warning("DEL container=%s netns=%r: the agent's record of this netns is pod %r's, not %r's: left "
                        "alone", container, netns, str(rec.get("uid"))[:128], uid)
            return
        _redirect_errors(api.teardown, netns, None, code=E_TEARDOWN)  # ours, whichever backend
        _redirect_errors(legacy.clear, netns, code=E_TEARDOWN)  # an earlier release's in-pod record
        _redirect_errors(store.remove, key, code=E_TEARDOWN)
    except CniError as e:
        if e.code != E_ENV or isinstance(e, NetnsRefused):
            raise


class NetnsRefused(CniError):
    """``CNI_NETNS`` is refused (code 7) by every command, DEL included, unlike a namespace that is
    gone: the host's own network namespace, or one the node agent refuses (another pod's)."""

    def __init__(self, msg: str) -> None:
        super().__init__(E_ENV, msg, "CNI_NETNS refused")


def _redirect_errors(fn: Any, *args: Any, code: int = E_SETUP) -> Any:
    from ..errors import BackendUnavailable, ConfigError, HostNetnsError, NetnsError, SetupError

    try:
        return fn(*args)
    except BackendUnavailable as e:
        raise CniError(E_BACKEND, str(e)) from None
    except HostNetnsError as e:
        raise NetnsRefused(f"CNI_NETNS: {e}") from None
    except NetnsError as e:
        raise CniError(E_ENV, f"CNI_NETNS: {e}") from None
    except ConfigError as e:
        raise CniError(E_INVALID_CONFIG, str(e)) from None
    except SetupError as e:
        raise CniError(code, str(e)) from None
    except TimeoutError as e:
        raise CniError(E_TRY_AGAIN, f"timed out: {e}") from None


def cmd_add(pc: PluginConf, env: Mapping[str, str], log: Any) -> dict[str, Any]:
    container = _env("CNI_CONTAINERID", env)
    netns = _env("CNI_NETNS", env)
    _env("CNI_IFNAME", env)
    result = convert_result(pc.prev_result, pc.cni_version)
    encode_result(result)  # one the thin plugin could not print fails here, before anything is installed
    cfg = _pod_config(pc, env, log)
    if cfg is None:
        return result
    if pc.mode == "ambient" and pc.agent:
        _ambient_add(pc, netns, container, parse_cni_args(env.get("CNI_ARGS", "")), cfg, log)
        return result
    from .. import api

    res = _redirect_errors(api.setup, netns, cfg, pc.backend)
    log.info("ADD container=%s netns=%s backend=%s families=%s changed=%s",
             container, netns, res.backend, res.families, res.changed)
    return result


def cmd_del(pc: PluginConf, env: Mapping[str, str], log: Any) -> None:
    if pc.mode == "ambient" and pc.agent:
        _ambient_del(pc, env, log)
        return
    container = _env("CNI_CONTAINERID", env, required=False)
    netns = env.get("CNI_NETNS", "")
    if _netns_gone(netns):
        log.info("DEL container=%s netns=%r: namespace gone, nothing to remove in it", container, netns)
        _collect_ebpf_garbage(pc, log)
        return
    from .. import api

    try:
        # Whichever backend put it there (the config's may have changed since the ADD).
        removed = _redirect_errors(api.teardown, netns, None, code=E_TEARDOWN)
    except CniError as e:
        if e.code == E_ENV and not isinstance(e, NetnsRefused):  # vanished between the exists() and the open
            log.info("DEL container=%s netns=%r: %s", container, netns, e.msg)
            return
        raise
    log.info("DEL container=%s netns=%s removed=%s", container, netns, removed)


def _collect_ebpf_garbage(pc: PluginConf, log: Any) -> None:
    """With the eBPF backend, a pod's entries live in host maps keyed by its netns cookie: drop
    those of namespaces that are gone (the kernel detaches a dead netns's link asynchronously,
    so a pod whose netns has only just gone may be collected by a later DEL or GC). With
    ``backend: "auto"`` pods may be on eBPF: collected whenever its host programs are pinned."""
    from ..backends import ebpf_root

    if pc.backend != "ebpf" and not (pc.backend == "auto" and os.path.isdir(ebpf_root())):
        return
    from ..backends import ebpf
    from ..errors import RedirectError

    try:
        gone = ebpf.collect_garbage()
    except RedirectError as e:
        raise CniError(E_TEARDOWN, f"backend ebpf: collecting pods whose netns is gone failed: {e}") from None
    log.info("ebpf: removed %d pod(s) whose netns is gone%s", len(gone), f": cookies {gone}" if gone else "")


def cmd_check(pc: PluginConf, env: Mapping[str, str], log: Any) -> None:
    if version_tuple(pc.cni_version) < (0, 4, 0):
        raise CniError(E_INCOMPATIBLE, f"cniVersion={pc.cni_version!r}: CHECK needs 0.4.0 or later")
    container = _env("CNI_CONTAINERID", env)
    netns = _env("CNI_NETNS", env)
    cfg = _pod_config(pc, env, log)
    if cfg is None:
        return
    if pc.mode == "ambient" and pc.agent:
        from ..ambient.agent.client import NO_ANSWER, AgentError, check_pod

        try:
            check_pod(pc.agent, uid=_pod_uid(container, parse_cni_args(env.get("CNI_ARGS", ""))), netns=netns,
                      timeout=pc.agent_timeout)
        except AgentError as e:
            code = E_CHECK if e.reason == "check" else E_TRY_AGAIN if e.reason in NO_ANSWER else E_AMBIENT
            raise CniError(code, f"node agent: {e}", f"agentSocket={pc.agent_socket}") from None
        return
    from .. import api

    res = _redirect_errors(api.check, netns, cfg, pc.backend)
    if not res.ok:
        raise CniError(E_CHECK, f"redirection in {netns} differs from the config", "; ".join(res.differences))
    log.info("CHECK container=%s netns=%s ok", container, netns)


def cmd_status(pc: PluginConf, env: Mapping[str, str], log: Any) -> None:
    import shutil

    from ..backends import BACKENDS

    if pc.backend in BACKENDS and pc.backend.startswith("iptables"):  # an unknown name: get_backend says why
        missing = [t for t in ("iptables-restore", "iptables-save", "ip6tables-restore", "ip6tables-save")
                   if shutil.which(t) is None]
        if missing:
            raise CniError(E_NOT_AVAILABLE, f"backend {pc.backend}: missing {', '.join(missing)}")
    else:
        from ..backends import get_backend

        try:
            get_backend(pc.backend, None)
        except Exception as e:  # noqa: BLE001 - any failure means "not available"
            raise CniError(E_NOT_AVAILABLE, f"backend {pc.backend}: {e}") from None
    if pc.mode == "ambient" and isinstance(pc.agent, str) and not os.path.exists(pc.agent):
        raise CniError(E_NOT_AVAILABLE, f"agentSocket {pc.agent_socket}: the node agent is not listening")


def run(env: Mapping[str, str], stdin: bytes,
        node_agent: AgentTarget | None = None) -> tuple[int, dict[str, Any] | None]:
    """One plugin invocation: (exit code, JSON to print or None).

    The Python plugin (``main``) and the node agent (``redirect.ambient.agent.cni_requests``, for the
    thin plugin) both call this. ``node_agent``: the agent serving the request in its own
    process; ambient pods are then enrolled by it directly, whatever ``agentSocket`` says.
    """
    command = env.get("CNI_COMMAND", "")
    version = LATEST
    log: Any = None
    try:
        # In the thin plugin's order (native/cni_thin.c), so that both answer any input alike.
        check_stdin_size(stdin)
        if command == "VERSION":
            try:  # the config's cniVersion, if stdin is one (as the thin plugin decodes it), else the latest
                v = decode_netconf(stdin).get("cniVersion") or LATEST
            except CniError:
                v = LATEST
            return 0, {"cniVersion": v if isinstance(v, str) else LATEST, "supportedVersions": list(SUPPORTED_VERSIONS)}
        if command not in COMMANDS:
            raise CniError(E_ENV, f"CNI_COMMAND={command!r}: expected ADD, DEL, CHECK, STATUS, GC or VERSION")
        conf = decode_netconf(stdin)
        if conf.get("cniVersion") in SUPPORTED_VERSIONS:
            version = conf["cniVersion"]
        try:
            check_env(env, command)
        except BadEnv as e:
            if command != "DEL":
                raise
            # No ADD took it, so nothing of ours is there; a DEL that failed would fail forever.
            import logging

            logging.getLogger("redirect.cni").warning("DEL: %s: nothing to remove", e.msg)
            return 0, None
        check_version(conf)
        pc = PluginConf(conf)
        if node_agent is not None:
            pc.agent = node_agent
        log = _AgentRequestLog(pc, env) if node_agent is not None else _setup_logging(pc, env)
        if command == "ADD":
            return 0, cmd_add(pc, env, log)
        if command == "DEL":
            cmd_del(pc, env, log)
        elif command == "CHECK":
            cmd_check(pc, env, log)
        elif command == "STATUS":
            cmd_status(pc, env, log)
        elif pc.backend in ("ebpf", "auto"):
            _collect_ebpf_garbage(pc, log)
        else:  # GC: our state lives only inside pod namespaces
            log.info("GC: nothing to collect")
        return 0, None
    except CniError as e:
        if log is not None:
            log.error("%s failed: code %d: %s %s", command, e.code, e.msg, e.details)
        return 1, {"cniVersion": version, "code": e.code, "msg": e.msg, "details": e.details}
    except Exception as e:  # noqa: BLE001 - the runtime must always get error JSON
        if log is not None:
            log.exception("%s failed", command)
        return 1, {"cniVersion": version, "code": E_SETUP, "msg": f"{type(e).__name__}: {brief_text(str(e))}",
                   "details": ""}


def _read_stdin(command: str) -> bytes:
    """Stdin (fd 0, whatever ``sys.stdin`` is) up to one byte past ``MAX_STDIN``, so that ``run``
    can tell a config that is too long; nothing for VERSION from a terminal."""
    if sys.stdin is None:  # fd 0 was closed when Python started (it may be another file by now)
        import errno

        raise OSError(errno.EBADF, os.strerror(errno.EBADF))
    if command == "VERSION" and os.isatty(0):
        return b""
    chunks: list[bytes] = []
    have = 0
    while have <= MAX_STDIN:
        chunk = os.read(0, MAX_STDIN + 1 - have)
        if not chunk:
            break
        chunks.append(chunk)
        have += len(chunk)
    return b"".join(chunks)


def main(argv: list[str] | None = None) -> int:
    """Entry point: the CNI plugin when ``CNI_COMMAND`` is set, else the installer CLI."""
    if "CNI_COMMAND" not in os.environ:
        from .install import cli_main

        return cli_main(sys.argv[1:] if argv is None else argv)
    out: dict[str, Any] | None
    try:
        stdin = _read_stdin(os.environ["CNI_COMMAND"])
    except OSError as e:  # closed (<&-), a directory...: as the thin plugin answers
        rc, out = 1, {"cniVersion": LATEST, "code": E_DECODE, "msg": "cannot read the network config on stdin",
                      "details": os.strerror(e.errno) if e.errno else str(e)}
    else:
        rc, out = run(os.environ, stdin)
    if out is not None:
        sys.stdout.buffer.write(encode_output(out))
        sys.stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
