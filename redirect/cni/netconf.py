"""The plugin's input and output, validated: the network config on stdin (``PluginConf``),
``CNI_ARGS``, the pod annotations a runtime passes, ``prevResult``, and our result in the
config's ``cniVersion``; the error codes of ``CniError``. What each field and code means is
said once, in ``redirect.cni.plugin``'s docstring. Pure: nothing here touches a kernel.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..ambient.agent.client import AgentTarget

from ..errors import brief

SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
LATEST = "1.1.0"
PLUGIN_TYPE = "redirect-cni"
COMMANDS = ("ADD", "DEL", "CHECK", "STATUS", "GC", "VERSION")

E_INCOMPATIBLE = 1
E_INVALID_CONFIG = 4
E_DECODE = 6
E_ENV = 7
E_TRY_AGAIN = 11
E_NOT_AVAILABLE = 50
E_SETUP = 100
E_ANNOTATION = 101
E_BACKEND = 102
E_AMBIENT = 103
E_CHECK = 104
E_TEARDOWN = 105

#: ``agentDown`` (the thin plugin, ``native/cni_thin.c``, when no agent listens at its socket):
#: fail with code 11 so the runtime retries, or exec the in-process Python plugin
AGENT_DOWN_POLICIES = ("tryAgain", "inProcess")
#: The longest network config accepted on stdin, in bytes (the thin plugin has the same bound).
MAX_STDIN = 1 << 20
#: The longest output the thin plugin copies from the agent (``native/cni_thin.c`` MAX_OUTPUT): an
#: ADD whose result would be longer is refused before anything is installed (``encode_result``).
MAX_OUTPUT = 2 * MAX_STDIN

#: The entry's settings where it does not set them (``redirect-cni install`` writes them all out,
#: so the node's conflist shows what is in force). Pods in ``excludeNamespaces`` are never captured:
#: kube-system by default, as Istio's CNI leaves it alone; an explicit ``[]`` excludes none.
DEFAULTS: dict[str, Any] = {
    "backend": "iptables",
    "mode": "sidecar",
    "capture": {},
    "excludeNamespaces": ["kube-system"],
    "logLevel": "info",
    "logFile": None,
    "logJson": False,
    "agentSocket": None,
    "agentTimeout": 10,
    "agentDown": AGENT_DOWN_POLICIES[0],
}

RUNTIME_ANNOTATION_KEYS = ("io.kubernetes.cri.pod-annotations", "podAnnotations")
CNI_ARGS_ANNOTATIONS = "REDIRECT_ANNOTATIONS"


class CniError(Exception):
    """An error the plugin reports as CNI error JSON."""

    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg
        self.details = details


# --- parsing -------------------------------------------------------------------------


def version_tuple(v: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in v.split("."))
    except ValueError:
        return (0,)


#: How deeply objects and arrays may nest in the config, the top-level object being the first
#: level (the thin plugin's bound; Python's decoder alone would take about twice as many).
MAX_DEPTH = 512
_TOO_DEEP = f"nested deeper than {MAX_DEPTH} levels"


def _not_json(word: str) -> Any:
    """``parse_constant``: NaN, Infinity and -Infinity are Python's, not JSON (RFC 8259)."""
    raise ValueError(f"{word} is not JSON")


def _deeper_than(value: object, limit: int) -> bool:
    """Whether objects and arrays nest more than ``limit`` levels in ``value`` (without recursion)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def check_stdin_size(raw: bytes) -> None:
    """Stdin larger than ``MAX_STDIN`` is error 6, whatever the command (VERSION included)."""
    if len(raw) > MAX_STDIN:
        raise CniError(E_DECODE, f"the network config on stdin is larger than {MAX_STDIN} bytes")


def decode_netconf(raw: bytes) -> dict[str, Any]:
    """The network config from stdin as a JSON object (else error 6); nothing in it checked yet."""
    check_stdin_size(raw)
    try:
        conf = json.loads(raw.decode("utf-8") or "{}", parse_constant=_not_json)
    except RecursionError:
        raise CniError(E_DECODE, "cannot decode the network config on stdin", _TOO_DEEP) from None
    except ValueError as e:  # not UTF-8, not JSON, NaN or Infinity, an integer too long to convert
        raise CniError(E_DECODE, "cannot decode the network config on stdin", brief(str(e))) from None
    if _deeper_than(conf, MAX_DEPTH):
        raise CniError(E_DECODE, "cannot decode the network config on stdin", _TOO_DEEP)
    if not isinstance(conf, dict):
        raise CniError(E_DECODE, "the network config on stdin must be a JSON object", brief(conf))
    return conf


def check_version(conf: Mapping[str, Any]) -> None:
    """``cniVersion`` is one we support: else error 4 (not a string) or 1."""
    version = conf.get("cniVersion")
    if not isinstance(version, str):
        raise CniError(E_INVALID_CONFIG, f"cniVersion={brief(version)}: missing or not a string")
    if version not in SUPPORTED_VERSIONS:
        raise CniError(E_INCOMPATIBLE, f"cniVersion={brief(version)}: unsupported",
                       f"supported: {', '.join(SUPPORTED_VERSIONS)}")


def parse_netconf(raw: bytes) -> dict[str, Any]:
    """The network config from stdin, with ``cniVersion`` checked."""
    conf = decode_netconf(raw)
    check_version(conf)
    return conf


#: The CNI parameters (spec 1.1 "Parameters"): the only variables the plugins read, and all the
#: thin plugin forwards to the agent.
CNI_ENV = ("CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH")
#: The longest value of one of them, in bytes (the thin plugin has the same bound).
MAX_ENV_VALUE = 32 * 1024
#: The longest they may be together, as JSON (a control character counts 6 bytes, ``"`` and
#: ``\`` 2), so that the thin plugin's message to the agent fits its 64 KiB.
MAX_ENV_TOTAL = 48 * 1024


def _json_len(raw: bytes) -> int:
    """The length of ``raw`` (UTF-8) inside a JSON string as the thin plugin writes it."""
    return len(raw) + 5 * sum(1 for b in raw if b < 0x20) + raw.count(b'"') + raw.count(b"\\")


class BadEnv(CniError):
    """A ``CNI_*`` variable no command takes (code 7): not UTF-8, too long, a relative ``CNI_NETNS``
    path. Nothing with it can have been installed (ADD refuses it), so a DEL with it succeeds."""

    def __init__(self, msg: str, details: str = "") -> None:
        super().__init__(E_ENV, msg, details)


def check_env(env: Mapping[str, str], command: str) -> None:
    """The ``CNI_*`` variables as both plugins check them before anything else of the request:
    each at most ``MAX_ENV_VALUE`` bytes of UTF-8, all of them at most ``MAX_ENV_TOTAL`` (as JSON),
    and for ADD, CHECK and DEL a ``CNI_NETNS`` that is absolute or a bare name (one under
    /run/netns): a relative path with a ``/`` would be resolved in whichever process serves the
    request (the thin plugin's agent has another working directory). ``BadEnv`` names the first
    bad one. ``env`` holds ``str`` as ``os.environ`` does (undecodable bytes as surrogates)."""
    import os

    total = 0
    for name in CNI_ENV:
        value = env.get(name)
        if value is None:
            continue
        try:
            raw = os.fsencode(value)
        except UnicodeEncodeError:  # a surrogate that stands for no byte
            raise BadEnv(f"{name} is not UTF-8") from None
        if len(raw) > MAX_ENV_VALUE:
            raise BadEnv(f"{name} is longer than {MAX_ENV_VALUE} bytes")
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadEnv(f"{name} is not UTF-8") from None
        total += _json_len(raw)
    if total > MAX_ENV_TOTAL:
        raise BadEnv(f"the CNI_* variables are longer than {MAX_ENV_TOTAL} bytes in all (as JSON)")
    netns = env.get("CNI_NETNS", "")
    if command in ("ADD", "CHECK", "DEL") and "/" in netns and not netns.startswith("/"):
        raise BadEnv("CNI_NETNS is a relative path: expected an absolute path, or a name under /run/netns", netns)


def parse_cni_args(text: str) -> dict[str, str]:
    """``CNI_ARGS`` (``K=V;K2=V2``) as a dict; a pair without ``=`` is error 7."""
    out: dict[str, str] = {}
    for pair in text.split(";"):
        if not pair.strip():
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CniError(E_ENV, f"CNI_ARGS: invalid pair {brief(pair)} (expected KEY=VALUE)")
        out[key.strip()] = value
    return out


def encode_annotations(annotations: Mapping[str, str]) -> str:
    """The ``REDIRECT_ANNOTATIONS`` value for ``CNI_ARGS``: unpadded base64url JSON."""
    import base64

    raw = json.dumps(dict(annotations), separators=(",", ":"), sort_keys=True).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _annotation_map(source: str, value: object) -> dict[str, str]:
    if value is None:  # (containerd's CRI sends null for a pod without annotations)
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise CniError(E_ANNOTATION, f"{source}: pod annotations must be a JSON object of strings to strings",
                       brief(value))
    return value


def pod_annotations(conf: Mapping[str, Any], cni_args: Mapping[str, str]) -> dict[str, str]:
    """The pod's annotations from every source the module docstring lists, merged in order."""
    out: dict[str, str] = {}
    args = conf.get("args")
    if isinstance(args, dict) and isinstance(args.get("cni"), dict) and "annotations" in args["cni"]:
        out.update(_annotation_map("args.cni.annotations", args["cni"]["annotations"]))
    rc = conf.get("runtimeConfig")
    if isinstance(rc, dict):
        for key in RUNTIME_ANNOTATION_KEYS:
            if key in rc:
                out.update(_annotation_map(f"runtimeConfig[{key!r}]", rc[key]))
    enc = cni_args.get(CNI_ARGS_ANNOTATIONS)
    if enc is not None:
        import base64
        import binascii

        try:
            decoded = json.loads(base64.urlsafe_b64decode(enc + "=" * (-len(enc) % 4)).decode("utf-8"))
        except (binascii.Error, ValueError, RecursionError) as e:
            raise CniError(E_ANNOTATION, f"CNI_ARGS {CNI_ARGS_ANNOTATIONS}: not base64url-encoded JSON",
                           f"{brief(enc, 60)}: {brief(str(e))}") from None
        out.update(_annotation_map(f"CNI_ARGS {CNI_ARGS_ANNOTATIONS}", decoded))
    return out


def _is_cidr(text: object) -> bool:
    """``text`` is an IP address with a prefix length in CIDR form (``10.0.0.2/24``, ``fd00::2/64``):
    not a bare address, a netmask (``/255.255.255.0``) or a zone (``fe80::1%eth0/64``), all of which
    ``ipaddress.ip_interface`` takes."""
    import ipaddress

    if not isinstance(text, str) or text.count("/") != 1 or "%" in text:
        return False
    address, prefix = text.split("/")
    if not (prefix.isascii() and prefix.isdigit() and len(prefix) <= 3) or (len(prefix) > 1 and prefix[0] == "0"):
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return int(prefix) <= ip.max_prefixlen


def _check_prev_result(prev: object) -> None:
    """``prevResult`` is an object whose ``ips`` (if any) are objects with an ``address`` in CIDR
    form: we convert it for older versions and give the addresses to the node agent."""

    if not isinstance(prev, dict):
        raise CniError(E_INVALID_CONFIG, f"prevResult={brief(prev)}: expected an object")
    ips = prev.get("ips")
    if ips is None:
        return
    if not isinstance(ips, list):
        raise CniError(E_INVALID_CONFIG, f"prevResult.ips={brief(ips)}: expected a list of objects")
    for i, ip in enumerate(ips):
        if not isinstance(ip, dict):
            raise CniError(E_INVALID_CONFIG, f"prevResult.ips[{i}]={brief(ip)}: expected an object")
        address = ip.get("address")
        if not _is_cidr(address):
            raise CniError(E_INVALID_CONFIG, f"prevResult.ips[{i}].address={brief(address)}: "
                           "expected an IP address with its prefix length (CIDR)")


#: The longest unix socket path (``sun_path`` less its NUL), in bytes: the thin plugin's bound too.
MAX_SOCKET_PATH = 107


def _socket_path_ok(path: object) -> bool:
    """``agentSocket`` as the thin plugin takes it: a non-empty path of at most ``MAX_SOCKET_PATH``
    bytes of UTF-8, without NUL."""
    if not isinstance(path, str) or not path or "\0" in path:
        return False
    try:
        return len(path.encode("utf-8")) <= MAX_SOCKET_PATH
    except UnicodeEncodeError:  # a lone surrogate
        return False


class PluginConf:
    """Our part of the network config, validated."""

    def __init__(self, conf: Mapping[str, Any]) -> None:
        self.raw = conf
        self.cni_version: str = conf["cniVersion"]
        self.name = conf.get("name", "")
        self.backend = conf.get("backend", DEFAULTS["backend"])
        if not isinstance(self.backend, str) or not self.backend:
            raise CniError(E_INVALID_CONFIG, f"backend={brief(self.backend)}: expected a backend name")
        self.mode = conf.get("mode", DEFAULTS["mode"])
        if self.mode not in ("sidecar", "ambient"):
            raise CniError(E_INVALID_CONFIG, f"mode={brief(self.mode)}: expected \"sidecar\" or \"ambient\"")
        self.capture = conf.get("capture", DEFAULTS["capture"])
        if not isinstance(self.capture, dict):
            raise CniError(E_INVALID_CONFIG,
                           f"capture={brief(self.capture)}: expected an object of RedirectConfig fields")
        excl = conf.get("excludeNamespaces", DEFAULTS["excludeNamespaces"])
        if not isinstance(excl, list) or not all(isinstance(n, str) for n in excl):
            raise CniError(E_INVALID_CONFIG, f"excludeNamespaces={brief(excl)}: expected a list of namespace names")
        self.exclude_namespaces = tuple(excl)
        self.log_level = conf.get("logLevel", DEFAULTS["logLevel"])
        if not isinstance(self.log_level, str) or self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise CniError(E_INVALID_CONFIG,
                           f"logLevel={brief(self.log_level)}: expected debug, info, warning or error")
        self.log_file = conf.get("logFile", DEFAULTS["logFile"])
        if self.log_file is not None and not isinstance(self.log_file, str):
            raise CniError(E_INVALID_CONFIG, f"logFile={brief(self.log_file)}: expected a path")
        self.log_json = conf.get("logJson", DEFAULTS["logJson"])
        if not isinstance(self.log_json, bool):
            raise CniError(E_INVALID_CONFIG, f"logJson={brief(self.log_json)}: expected true or false")
        self.agent_socket = conf.get("agentSocket", DEFAULTS["agentSocket"])
        if self.agent_socket is not None and not _socket_path_ok(self.agent_socket):
            raise CniError(E_INVALID_CONFIG, f"agentSocket={brief(self.agent_socket)}: expected a path of at most "
                           f"{MAX_SOCKET_PATH} bytes")
        self.agent_timeout = conf.get("agentTimeout", DEFAULTS["agentTimeout"])
        if isinstance(self.agent_timeout, bool) or not isinstance(self.agent_timeout, (int, float)) \
                or not 0 < self.agent_timeout <= 300:
            raise CniError(E_INVALID_CONFIG, f"agentTimeout={brief(self.agent_timeout)}: expected seconds in (0, 300]")
        self.agent_down = conf.get("agentDown", DEFAULTS["agentDown"])
        if self.agent_down not in AGENT_DOWN_POLICIES:
            raise CniError(E_INVALID_CONFIG, f"agentDown={brief(self.agent_down)}: expected "
                           + " or ".join(f'"{p}"' for p in AGENT_DOWN_POLICIES))
        #: where ambient pods go: the node agent's events socket, or the agent itself when it
        #: serves this request in its own process (``run(..., node_agent=...)``)
        self.agent: AgentTarget | None = self.agent_socket
        self.prev_result = conf.get("prevResult")
        if self.prev_result is not None:
            _check_prev_result(self.prev_result)

    def base_config(self) -> Any:
        """The default ``RedirectConfig`` from ``capture`` and ``mode``."""
        from ..config import RedirectConfig
        from ..errors import ConfigError

        data = dict(self.capture)
        data.setdefault("mode", self.mode)
        try:
            return RedirectConfig.from_dict(data)
        except ConfigError as e:
            raise CniError(E_INVALID_CONFIG, f"capture.{e}", "") from None


# --- results ---------------------------------------------------------------------------


def encode_output(out: Mapping[str, Any]) -> bytes:
    """What the plugin prints, the Python plugin and the agent (for the thin plugin) alike: compact
    JSON with text as it came (UTF-8, not ``\\u`` escapes, so no string is longer than it was on
    stdin; a lone surrogate, which UTF-8 cannot carry, as its ``\\u`` escape), and a newline."""
    text = json.dumps(out, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return (text + "\n").encode("utf-8", "backslashreplace")


def encode_result(result: Mapping[str, Any]) -> bytes:
    """``encode_output(result)``, refused (code 4) when it would be longer than ``MAX_OUTPUT``: ADD
    encodes its result before it installs anything, so a result the thin plugin could not print
    fails the ADD with nothing installed. Text never grows (``encode_output``), but numbers may
    (``1e15`` prints as ``1000000000000000.0``) and an older ``cniVersion`` adds ``ips[].version``."""
    try:
        data = encode_output(result)
    except ValueError as e:  # a number out of range (inf)
        raise CniError(E_INVALID_CONFIG, f"prevResult: {brief(str(e))}") from None
    if len(data) > MAX_OUTPUT:
        raise CniError(E_INVALID_CONFIG, f"prevResult: our result would be {len(data)} bytes, more than "
                       f"{MAX_OUTPUT}", "numbers such as 1e15 print longer than they were written")
    return data


def convert_result(result: Mapping[str, Any] | None, version: str) -> dict[str, Any]:
    """``result`` in ``version``'s format: ``ips[].version`` exists before 1.0.0 only."""
    if not result:
        out: dict[str, Any] = {"cniVersion": version, "interfaces": [], "ips": [], "dns": {}}
        return out
    out = dict(result)
    modern = version_tuple(version) >= (1, 0, 0)
    ips = []
    for ip in out.get("ips") or []:
        ip = dict(ip)
        if modern:
            ip.pop("version", None)
        elif "version" not in ip and isinstance(ip.get("address"), str):
            ip["version"] = "6" if ":" in ip["address"] else "4"
        ips.append(ip)
    if "ips" in out:
        out["ips"] = ips
    out["cniVersion"] = version
    return out
