"""``RedirectConfig``: one frozen, validated description of what to capture.

Build it from Python keywords (``RedirectConfig(outbound_exclude_ports=(22,))``), a
mapping (``from_dict``), JSON or YAML text (``from_json`` / ``from_yaml``), Istio's
``istio-iptables`` flags and env vars (``redirect.istio.flags.config_from_istio_args``) or pod
annotations (``redirect.istio.annotations``). Every value is checked once here; a bad one
raises ``ConfigError`` naming the field and the value, before anything touches a
kernel. Nothing downstream re-validates.

Port, CIDR and id lists accept Python sequences or comma-separated strings; ``"*"``
means "all" where a field allows it, and an empty value means "none". Numbers in strings
are ASCII digits only (marks may be ``0x`` hex). A JSON or YAML document (text or file)
may be at most ``MAX_CONFIG_BYTES`` (256 KiB) long; error messages show at most a
couple of hundred characters of a value.
"""

from __future__ import annotations

import argparse
import dataclasses
import grp
import ipaddress
import json
import pwd
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, Union

from .errors import ConfigError, brief, brief_text

Mode = Literal["sidecar", "ambient"]
Interception = Literal["REDIRECT", "TPROXY"]
#: A uid/gid: one id, or an inclusive range ``(low, high)``.
IdSpec = Union[int, tuple[int, int]]
Ports = Union[Literal["*"], tuple[int, ...]]
Cidrs = Union[Literal["*"], tuple[str, ...]]
Groups = Union[Literal["*"], tuple[IdSpec, ...]]

_MAX_ID = 2**32 - 2  # (uid_t)-1 is "no id"
#: The longest JSON or YAML config document accepted (a file's bytes, a string's characters).
MAX_CONFIG_BYTES = 256 * 1024
#: The addresses kubelet probes to ambient pods are SNAT'd to on the node (Istio's
#: ``HOST_PROBE_SNAT_ADDRESS`` / ``HOST_PROBE_V6_SNAT_ADDRESS`` defaults).
PROBE_SNAT = {4: "169.254.7.127", 6: "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"}
# ASCII digits only: ``int()`` and ``\d`` also accept other scripts' digits and "1_0".
_DEC = re.compile(r"[0-9]{1,20}")
_DEC_OR_HEX = re.compile(r"[0-9]{1,20}|0x[0-9a-f]{1,16}")
_ID_RANGE = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
#: Characters an interface name may not contain: the kernel refuses '/' and ':' (and whitespace,
#: with printable ASCII required anyway); the others mean something where names are written
#: (lists, iptables-restore quoting, nftables wildcards and escapes).
_IFNAME_BAD = frozenset('/:,"\'*\\')


@dataclass(frozen=True)
class RedirectConfig:
    """What to capture in one pod network namespace (Istio's defaults)."""

    mode: Mode = "sidecar"
    #: Proxy outbound capture port (Istio 15001).
    proxy_port: int = 15001
    #: Proxy inbound capture port (Istio 15006).
    inbound_port: int = 15006
    #: HBONE tunnel port, never captured inbound (Istio 15008).
    tunnel_port: int = 15008
    #: DNS proxy port (Istio 15053).
    dns_port: int = 15053
    #: Proxy identity in sidecar mode: its traffic is never captured again.
    proxy_uids: tuple[IdSpec, ...] = (1337,)
    proxy_gids: tuple[IdSpec, ...] = (1337,)
    #: How inbound reaches the proxy: NAT ``REDIRECT`` or ``TPROXY`` (keeps the original dst).
    inbound_interception: Interception = "REDIRECT"
    tproxy_mark: int = 1337
    tproxy_route_table: int = 133
    #: Inbound ports to capture: ``"*"`` = all, ``()`` = none.
    inbound_ports: Ports = "*"
    inbound_exclude_ports: tuple[int, ...] = (15090, 15021, 15020)
    #: Outbound destinations to capture: ``"*"`` = all, ``()`` = none.
    outbound_cidrs: Cidrs = "*"
    outbound_exclude_cidrs: tuple[str, ...] = ()
    #: Outbound ports captured even when their destination is not in ``outbound_cidrs``.
    outbound_ports: tuple[int, ...] = ()
    outbound_exclude_ports: tuple[int, ...] = ()
    #: Only traffic of processes in these groups is captured (``"*"`` = all).
    owner_groups: Groups = "*"
    #: Traffic of processes in these groups is never captured.
    owner_groups_exclude: tuple[IdSpec, ...] = ()
    #: Interfaces whose traffic is never captured.
    exclude_interfaces: tuple[str, ...] = ()
    #: Interfaces whose inbound traffic is sent to the outbound port (Istio's kube-virt).
    reroute_interfaces: tuple[str, ...] = ()
    #: DNS to port 53 goes to ``dns_port``.
    dns_capture: bool = False
    #: Capture DNS to every server, not just ``dns_servers``.
    capture_all_dns: bool = False
    dns_servers: tuple[str, ...] = ()
    #: With DNS capture, the proxy gids' hairpin rule (their lo traffic to a non-loopback address
    #: goes to inbound capture) leaves port 53 alone, as the uids' does. istio-iptables leaves only
    #: the tunnel port alone for gids; ``redirect init`` sets False to match it exactly.
    gid_hairpin_skips_dns: bool = True
    #: Drop packets conntrack deems INVALID (out-of-window) instead of letting them reset.
    drop_invalid: bool = False
    #: eBPF only: the app <-> proxy connections of the pod have each send moved to the peer socket's
    #: receive queue (a sockmap) instead of going through loopback TCP. Off by default: see
    #: docs/backends.md for what it changes that applications can see.
    sockmap: bool = False
    #: The loopback range that is never captured (Istio's ``ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR``).
    ipv4_loopback_cidr: str = "127.0.0.1/32"
    #: IPv6 rules: True, False, or None = whenever the namespace has IPv6.
    ipv6: bool | None = None
    # --- ambient mode -----------------------------------------------------------
    #: The node proxy's socket mark and its mask (Istio 0x539/0xfff).
    proxy_mark: int = 0x539
    proxy_mark_mask: int = 0xFFF
    #: Connmark of connections the node proxy owns; their replies route locally.
    conn_mark: int = 0x111
    #: Policy-routing table for those replies (Istio 100).
    route_table: int = 100
    #: Istio's ingress mode: inbound is not captured.
    bypass_inbound_capture: bool = False
    #: Source addresses kubelet probes are SNAT'd to, accepted in-pod.
    probe_snat_ipv4: str = PROBE_SNAT[4]
    probe_snat_ipv6: str = PROBE_SNAT[6]

    def __post_init__(self) -> None:
        _validate(self)

    def __hash__(self) -> int:
        # Computed once: configs key the intent and backend caches on every setup, and a hash of
        # every field (nested tuples) is the same each time.
        h: int | None = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    # --- builders ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RedirectConfig:
        """Build from a mapping of field names (``-`` and ``_`` both accepted)."""
        if not isinstance(data, Mapping):
            raise ConfigError("config", data, "must be a mapping of field names to values")
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if not isinstance(key, str):
                raise ConfigError(brief(key, 60), value, "field names are strings")
            name = key.replace("-", "_")
            if name not in known:
                raise ConfigError(brief_text(key, 60), value,
                                  f"unknown field; known fields: {', '.join(sorted(known))}")
            kwargs[name] = value
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> RedirectConfig:
        """Build from a JSON object of field names (at most ``MAX_CONFIG_BYTES`` characters)."""
        return cls.from_dict(_decode(text, "JSON", "config", text))

    @classmethod
    def from_yaml(cls, text: str) -> RedirectConfig:
        """Build from a YAML mapping of field names (at most ``MAX_CONFIG_BYTES`` characters)."""
        return cls.from_dict(_decode(text, "YAML", "config", text))

    @classmethod
    def from_file(cls, path: str) -> RedirectConfig:
        """Build from a ``.json``, ``.yaml`` or ``.yml`` file (UTF-8, at most ``MAX_CONFIG_BYTES``)."""
        import os

        path = os.fspath(path)
        try:
            raw = read_regular_file(path, MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise ConfigError("config", path, f"cannot read: {e.strerror or e}") from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError("config", path, f"larger than {MAX_CONFIG_BYTES} bytes, the limit for a config file")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError("config", path, f"not UTF-8 text: byte {e.start} is {raw[e.start:e.start + 1]!r}") \
                from None
        return cls.from_dict(_decode(text, "JSON" if path.endswith(".json") else "YAML", "config", path))

    def replace(self, **changes: Any) -> RedirectConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: tuples become lists, id ranges become ``"low-high"``."""

        def conv(v: Any) -> Any:
            if isinstance(v, tuple):
                return [f"{x[0]}-{x[1]}" if isinstance(x, tuple) else x for x in v]
            return v

        return {f.name: conv(getattr(self, f.name)) for f in fields(self)}

    # --- derived views used by the planner ---------------------------------------------
    def cidrs_of_family(self, cidrs: Iterable[str], family: int) -> tuple[str, ...]:
        return tuple(c for c in cidrs if ipaddress.ip_network(c).version == family)

    def dns_servers_of_family(self, family: int) -> tuple[str, ...]:
        return tuple(s for s in self.dns_servers if ipaddress.ip_address(s).version == family)

    @property
    def dns_effective(self) -> bool:
        """Istio turns DNS capture off when neither all DNS nor any server is named."""
        return self.dns_capture and (self.capture_all_dns or bool(self.dns_servers))


def read_regular_file(path: str, limit: int) -> bytes:
    """At most ``limit`` bytes of the regular file at ``path``; ``OSError`` for anything else.

    Only a regular file is read: the path is looked at first, so a FIFO or a device is refused
    without being opened (a FIFO's open would wait for a writer), and the open itself does not
    block (``O_NONBLOCK``, should the path be swapped meanwhile), then what it opened is checked
    again. Used for every file a user names (config files, the CLI's and the installer's inputs)."""
    import errno
    import os
    import stat

    def refuse(st: os.stat_result) -> OSError:
        kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                 (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
        what = next((w for test, w in kinds if test(st.st_mode)), "something else")
        return OSError(errno.EINVAL, f"{path} is {what}, not a regular file")

    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise refuse(st)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise refuse(opened)
        chunks: list[bytes] = []
        size = 0
        while size < limit:
            chunk = os.read(fd, limit - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _decode(text: str, kind: str, field: str, source: object) -> Any:
    """The document in ``text`` (``kind`` "JSON" or "YAML"); a ``ConfigError`` naming ``field`` and
    ``source`` (the text itself, or the file it came from) when it is too long or does not decode."""
    if not isinstance(text, str):
        raise ConfigError(field, source, f"expected {kind} text, not {type(text).__name__}")
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(field, source, f"{len(text)} characters: longer than the {MAX_CONFIG_BYTES} allowed")
    load: Callable[[str], Any]
    errors: tuple[type[Exception], ...]
    if kind == "JSON":
        load, errors = _json_unique, (ValueError,)
    else:
        import yaml

        load, errors = _yaml_unique, (ValueError, yaml.YAMLError)
    try:
        data = load(text)
    except _DuplicateKey as e:
        raise ConfigError(field, source, f"duplicate key {brief(e.key, 60)}{e.where}: a key may appear once in"
                          " an object (else the last would silently win)") from None
    except RecursionError:
        raise ConfigError(field, source, f"not valid {kind}: nested too deeply") from None
    except errors as e:  # also ValueError: an integer too long for Python to convert
        raise ConfigError(field, source, f"not valid {kind}: {brief_text(str(e))}") from None
    return {} if data is None and kind == "YAML" else data  # an empty YAML document: the defaults


class _DuplicateKey(Exception):
    """A key given twice in one object of a config document (``where``: its place, if known)."""

    def __init__(self, key: object, where: str = "") -> None:
        super().__init__(key)
        self.key, self.where = key, where


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _json_unique(text: str) -> Any:
    """``json.loads``, refusing an object with a key given twice (``_DuplicateKey``)."""
    return json.loads(text, object_pairs_hook=_unique_pairs)


_yaml_loader: Any = None


def _yaml_unique(text: str) -> Any:
    """``yaml.safe_load``, refusing a mapping with a key given twice (``_DuplicateKey``). Keys a
    merge (``<<``) brings in may be given again: in YAML the mapping's own keys win over merged
    ones on purpose."""
    global _yaml_loader
    if _yaml_loader is None:
        import yaml

        class UniqueKeyLoader(yaml.SafeLoader):
            def construct_mapping(self, node: Any, deep: bool = False) -> Any:
                if isinstance(node, yaml.MappingNode):
                    seen: set[Any] = set()
                    for key_node, _ in node.value:
                        if key_node.tag == "tag:yaml.org,2002:merge":
                            continue
                        key = self.construct_object(key_node, deep=deep)
                        try:
                            if key in seen:
                                raise _DuplicateKey(key, f" (line {key_node.start_mark.line + 1})")
                            seen.add(key)
                        except TypeError:  # unhashable: the base constructor says so
                            pass
                return super().construct_mapping(node, deep)

        _yaml_loader = UniqueKeyLoader
    import yaml

    return yaml.load(text, Loader=_yaml_loader)  # noqa: S506 - a SafeLoader


# --- validation ----------------------------------------------------------------------


def _set(cfg: RedirectConfig, name: str, value: object) -> None:
    object.__setattr__(cfg, name, value)


def _split(value: object) -> list[object]:
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    raise TypeError


def _port(name: str, raw: object, value: object) -> int:
    if isinstance(value, bool):
        raise ConfigError(name, raw, "ports must be integers 1-65535, not booleans")
    port: int | None = None
    if isinstance(value, int):
        port = value
    elif isinstance(value, str) and _DEC.fullmatch(value.strip()):
        port = int(value.strip())
    if port is None or not 1 <= port <= 65535:
        raise ConfigError(name, raw, f"{brief(value)} is not a port (1-65535)")
    return port


def _star(value: object) -> bool:
    return value == "*" or value == ["*"] or value == ("*",)


def _items(name: str, value: object, star: bool, what: str) -> list[object]:
    try:
        items = _split(value)
    except TypeError:
        raise ConfigError(name, value, f"expected a list of {what} or a comma-separated string") from None
    if "*" in items:
        raise ConfigError(name, value, '"*" is not allowed here' if not star else '"*" must stand alone')
    return items


def _list(name: str, value: object, star: bool, what: str, item: Callable[[object], Any]) -> Any:
    """``"*"`` (where ``star`` allows it) or the tuple of ``item(x)`` for each x, in order, once each."""
    if star and _star(value):
        return "*"
    return tuple(dict.fromkeys(item(x) for x in _items(name, value, star, what)))


def _ports(name: str, value: object, star: bool) -> Ports:
    return _list(name, value, star, "ports", lambda x: _port(name, value, x))


def _cidr(name: str, raw: object, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(name, raw, f"{brief(value)} is not a CIDR string")
    try:
        net = ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        raise ConfigError(name, raw, f"{brief(value)} is not an IPv4 or IPv6 CIDR") from None
    return str(net)


def _cidrs(name: str, value: object, star: bool) -> Cidrs:
    return _list(name, value, star, "CIDRs", lambda x: _cidr(name, value, x))


def _id(name: str, raw: object, value: object, kind: str) -> IdSpec:
    if isinstance(value, bool):
        raise ConfigError(name, raw, f"{brief(value)} is not a {kind} id")
    if isinstance(value, int):
        n = value
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        lo = _id(name, raw, value[0], kind)
        hi = _id(name, raw, value[1], kind)
        if not isinstance(lo, int) or not isinstance(hi, int) or lo > hi:
            raise ConfigError(name, raw, f"{brief(value)} is not a {kind} id range low-high")
        return (lo, hi) if lo != hi else lo
    elif isinstance(value, str):
        s = value.strip()
        if _DEC.fullmatch(s):
            n = int(s)
        elif m := _ID_RANGE.fullmatch(s):
            return _id(name, raw, (int(m[1]), int(m[2])), kind)
        else:
            try:
                n = pwd.getpwnam(s).pw_uid if kind == "user" else grp.getgrnam(s).gr_gid
            except (KeyError, ValueError):
                raise ConfigError(name, raw, f"{brief(s)} is not a number, a range, or a known {kind} name") from None
    else:
        raise ConfigError(name, raw, f"{brief(value)} is not a {kind} id")
    if not 0 <= n <= _MAX_ID:
        raise ConfigError(name, raw, f"{brief(n)} is out of range for a {kind} id (0-{_MAX_ID})")
    return n


def _ids(name: str, value: object, kind: str, star: bool = False) -> Any:
    return _list(name, value, star, f"{kind} ids", lambda x: _id(name, value, x, kind))


def _ifname_problem(item: object) -> str | None:
    """Why ``item`` is not an interface name we accept, or None. The kernel's rules (1-15 bytes,
    not "." or "..", no '/', ':' or whitespace), in printable ASCII, and nothing that iptables or
    nftables would read as more than a name: '+' at the end is iptables' wildcard (``l+``
    matches lo), a leading '-' or '!' an option or a negation."""
    if not isinstance(item, str):
        return "interface names are strings"
    if not 1 <= len(item) <= 15:
        return "an interface name is 1-15 characters"
    if not (item.isascii() and item.isprintable()) or " " in item:
        return "an interface name is printable ASCII without spaces"
    if item in (".", ".."):
        return '"." and ".." are not interface names'
    bad = sorted(set(item) & _IFNAME_BAD)
    if bad:
        return f"an interface name may not contain {' '.join(bad)}"
    if item[0] in "-!":
        return f"an interface name may not start with {item[0]} (iptables reads an option or a negation)"
    if item.endswith("+"):
        return "an interface name may not end with + (an iptables wildcard: it would match other interfaces)"
    return None


def _ifaces(name: str, value: object) -> tuple[str, ...]:
    try:
        items = _split(value)
    except TypeError:
        raise ConfigError(name, value, "expected a list of interface names") from None
    for item in items:
        why = _ifname_problem(item)
        if why is not None:
            raise ConfigError(name, value, f"{brief(item)} is not a valid interface name: {why}")
    return tuple(dict.fromkeys(items))  # type: ignore[arg-type]


def _int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool):
        raise ConfigError(name, value, f"expected an integer {lo}-{hi}")
    if isinstance(value, str):
        s = value.strip().lower()
        if not _DEC_OR_HEX.fullmatch(s):
            raise ConfigError(name, value, f"expected an integer {lo}-{hi} (decimal, or hex with 0x)")
        value = int(s, 16) if s.startswith("0x") else int(s)
    if not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(name, value, f"expected an integer {lo}-{hi}")
    return value


_SECONDS = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?")


def int_arg(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer option in ``lo``..``hi``, read as config fields are:
    ASCII decimal or ``0x`` hex (``int`` would take other scripts' digits and ``1_0``)."""

    def parse(text: str) -> int:
        try:
            return _int("value", text, lo, hi)
        except ConfigError:
            raise argparse.ArgumentTypeError(f"{brief(text)}: expected an integer {lo}-{hi}") from None

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def seconds_arg(lo: float, hi: float) -> Callable[[str], float]:
    """An argparse ``type`` for a duration in seconds in ``lo``..``hi``: ASCII decimal
    (``float`` would take ``nan``, ``inf``, ``1e9`` and other scripts' digits)."""

    def parse(text: str) -> float:
        s = text.strip()
        if not _SECONDS.fullmatch(s) or not lo <= float(s) <= hi:
            raise argparse.ArgumentTypeError(f"{brief(text)}: expected seconds {lo:g}-{hi:g} (e.g. 2.5)")
        return float(s)

    parse.__name__ = "seconds"
    return parse


def _bool(name: str, value: object, allow_none: bool = False) -> bool | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        s = value.strip().lower()
        if s in ("true", "1", "yes", "on"):
            return True
        if s in ("false", "0", "no", "off"):
            return False
        if allow_none and s in ("auto", ""):
            return None
    raise ConfigError(name, value, "expected true or false" + (" or auto" if allow_none else ""))


def normalize_ip(value: object, version: int | None = None) -> str | None:
    """``value`` (text, surrounding blanks ignored, or an ``ipaddress`` address) as the canonical
    text of an IP address of ``version`` (4, 6, or None: either); None if it is not one."""
    if isinstance(value, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
        value = str(value)
    if not isinstance(value, str):
        return None
    try:
        a = ipaddress.ip_address(value.strip())
    except ValueError:
        return None
    return str(a) if version is None or a.version == version else None


def _addr(name: str, value: object, version: int) -> str:
    a = normalize_ip(value, version)
    if a is None:
        raise ConfigError(name, value, f"not an IPv{version} address")
    return a


def _validate(cfg: RedirectConfig) -> None:
    if cfg.mode not in ("sidecar", "ambient"):
        raise ConfigError("mode", cfg.mode, 'expected "sidecar" or "ambient"')
    mode = str(cfg.inbound_interception).upper() if isinstance(cfg.inbound_interception, str) else None
    if mode not in ("REDIRECT", "TPROXY"):
        raise ConfigError("inbound_interception", cfg.inbound_interception, 'expected "REDIRECT" or "TPROXY"')
    _set(cfg, "inbound_interception", mode)

    for name in ("proxy_port", "inbound_port", "tunnel_port", "dns_port"):
        _set(cfg, name, _port(name, getattr(cfg, name), getattr(cfg, name)))
    for name in ("inbound_exclude_ports", "outbound_ports", "outbound_exclude_ports"):
        _set(cfg, name, _ports(name, getattr(cfg, name), star=False))
    _set(cfg, "inbound_ports", _ports("inbound_ports", cfg.inbound_ports, star=True))

    _set(cfg, "outbound_cidrs", _cidrs("outbound_cidrs", cfg.outbound_cidrs, star=True))
    # Istio rejects "*" for the exclude list (OUTBOUND_IP_RANGES_EXCLUDE).
    _set(cfg, "outbound_exclude_cidrs", _cidrs("outbound_exclude_cidrs", cfg.outbound_exclude_cidrs, star=False))
    _set(cfg, "ipv4_loopback_cidr", _cidr("ipv4_loopback_cidr", cfg.ipv4_loopback_cidr, cfg.ipv4_loopback_cidr))
    lo_net = ipaddress.ip_network(cfg.ipv4_loopback_cidr)
    if lo_net.version != 4 or not lo_net.subnet_of(ipaddress.ip_network("127.0.0.0/8")):  # type: ignore[arg-type]
        raise ConfigError("ipv4_loopback_cidr", cfg.ipv4_loopback_cidr, "must be an IPv4 range inside 127.0.0.0/8")

    _set(cfg, "proxy_uids", _ids("proxy_uids", cfg.proxy_uids, "user"))
    _set(cfg, "proxy_gids", _ids("proxy_gids", cfg.proxy_gids, "group"))
    _set(cfg, "owner_groups", _ids("owner_groups", cfg.owner_groups, "group", star=True))
    _set(cfg, "owner_groups_exclude", _ids("owner_groups_exclude", cfg.owner_groups_exclude, "group"))
    if cfg.owner_groups != "*" and cfg.owner_groups_exclude:
        raise ConfigError(
            "owner_groups_exclude",
            cfg.owner_groups_exclude,
            "set either owner_groups (a list) or owner_groups_exclude, not both",
        )
    if cfg.owner_groups == ():
        raise ConfigError("owner_groups", "", 'empty: use "*" for every group')

    _set(cfg, "exclude_interfaces", _ifaces("exclude_interfaces", cfg.exclude_interfaces))
    _set(cfg, "reroute_interfaces", _ifaces("reroute_interfaces", cfg.reroute_interfaces))
    both = set(cfg.exclude_interfaces) & set(cfg.reroute_interfaces)
    if both:
        raise ConfigError("reroute_interfaces", cfg.reroute_interfaces, f"also excluded: {', '.join(sorted(both))}")
    if "lo" in cfg.exclude_interfaces or "lo" in cfg.reroute_interfaces:
        bad = "exclude_interfaces" if "lo" in cfg.exclude_interfaces else "reroute_interfaces"
        raise ConfigError(bad, getattr(cfg, bad), '"lo" carries the proxy hand-off and cannot be listed')

    for name in ("dns_capture", "capture_all_dns", "gid_hairpin_skips_dns", "drop_invalid", "bypass_inbound_capture",
                 "sockmap"):
        _set(cfg, name, _bool(name, getattr(cfg, name)))
    _set(cfg, "ipv6", _bool("ipv6", cfg.ipv6, allow_none=True))
    try:
        servers = _split(cfg.dns_servers)
    except TypeError:
        raise ConfigError("dns_servers", cfg.dns_servers, "expected a list of IP addresses") from None
    out: dict[str, None] = {}
    for s in servers:
        a = normalize_ip(s)
        if a is None:
            raise ConfigError("dns_servers", cfg.dns_servers, f"{brief(s)} is not an IP address")
        out[a] = None
    _set(cfg, "dns_servers", tuple(out))

    _set(cfg, "tproxy_mark", _int("tproxy_mark", cfg.tproxy_mark, 1, 2**32 - 1))
    _set(cfg, "tproxy_route_table", _int("tproxy_route_table", cfg.tproxy_route_table, 1, 2**31 - 1))
    _set(cfg, "route_table", _int("route_table", cfg.route_table, 1, 2**31 - 1))
    for name in ("tproxy_route_table", "route_table"):
        if getattr(cfg, name) in (253, 254, 255):
            raise ConfigError(name, getattr(cfg, name), "253-255 are the kernel's default/main/local tables")
    _set(cfg, "proxy_mark", _int("proxy_mark", cfg.proxy_mark, 1, 2**32 - 1))
    _set(cfg, "proxy_mark_mask", _int("proxy_mark_mask", cfg.proxy_mark_mask, 1, 2**32 - 1))
    _set(cfg, "conn_mark", _int("conn_mark", cfg.conn_mark, 1, 2**32 - 1))
    if cfg.proxy_mark & ~cfg.proxy_mark_mask:
        raise ConfigError("proxy_mark", hex(cfg.proxy_mark),
                          f"has bits outside proxy_mark_mask {cfg.proxy_mark_mask:#x}")
    if cfg.conn_mark & ~cfg.proxy_mark_mask:
        raise ConfigError("conn_mark", hex(cfg.conn_mark),
                          f"has bits outside proxy_mark_mask {cfg.proxy_mark_mask:#x}")
    if cfg.conn_mark == cfg.proxy_mark:
        raise ConfigError("conn_mark", hex(cfg.conn_mark), "must differ from proxy_mark")
    if cfg.tproxy_mark == 1338:
        raise ConfigError("tproxy_mark", 1338, "1338 is the mark of proxy-to-app traffic over lo; pick another")
    _set(cfg, "probe_snat_ipv4", _addr("probe_snat_ipv4", cfg.probe_snat_ipv4, 4))
    _set(cfg, "probe_snat_ipv6", _addr("probe_snat_ipv6", cfg.probe_snat_ipv6, 6))

    ports = {"proxy_port": cfg.proxy_port, "inbound_port": cfg.inbound_port, "tunnel_port": cfg.tunnel_port}
    if cfg.dns_capture:
        ports["dns_port"] = cfg.dns_port
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if port in seen:
            raise ConfigError(name, port, f"same port as {seen[port]}")
        seen[port] = name
    if cfg.mode == "ambient" and cfg.inbound_interception == "TPROXY":
        raise ConfigError("inbound_interception", "TPROXY", "ambient mode has no inbound interception choice")
    if cfg.mode == "sidecar" and not cfg.proxy_uids and not cfg.proxy_gids:
        raise ConfigError("proxy_uids", (), "sidecar mode needs a proxy uid or gid, or the proxy captures itself")


def field_names() -> list[str]:
    return [f.name for f in fields(RedirectConfig)]


__all__ = ["RedirectConfig", "IdSpec", "field_names"]
