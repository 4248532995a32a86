"""``istio-iptables`` compatibility: its flags and environment variables -> ``RedirectConfig``.

``redirect init`` accepts the same flags as Istio's ``istio-iptables`` (and its
``pilot-agent istio-iptables`` form), with the same defaults and the same
environment-variable fallbacks (flag ``--istio-service-cidr`` <-> ``ISTIO_SERVICE_CIDR``,
Istio's viper convention: upper case, ``-`` becomes ``_``). Called bare, like
``istio-iptables``, it captures nothing but sets up the redirect chains; the injector's
usual call is ``-p 15001 -z 15006 -u 1337 -m REDIRECT -i '*' -x '' -b '*' -d 15090,15021,15020``.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import RedirectConfig
from ..errors import ConfigError

#: (short, long, RedirectConfig field or None, default, help). Env var = long upper-cased.
STRING_FLAGS: list[tuple[str | None, str, str | None, str, str]] = [
    ("-p", "--envoy-port", "proxy_port", "15001", "port all outbound TCP is redirected to"),
    ("-z", "--inbound-capture-port", "inbound_port", "15006", "port all inbound TCP is redirected to"),
    ("-e", "--inbound-tunnel-port", "tunnel_port", "15008", "tunnel (HBONE) port, never captured inbound"),
    ("-u", "--proxy-uid", "proxy_uids", "",
     "uids not captured (default: the uid of user $ENVOY_USER, istio-proxy when unset, else 1337)"),
    ("-g", "--proxy-gid", "proxy_gids", "", "gid(s) whose traffic is not captured (default: same as -u)"),
    ("-m", "--istio-inbound-interception-mode", "inbound_interception", "REDIRECT", "REDIRECT or TPROXY"),
    ("-b", "--istio-inbound-ports", "inbound_ports", "", 'inbound ports to capture; "*" = all, empty = none'),
    ("-d", "--istio-local-exclude-ports", "inbound_exclude_ports", "", 'inbound ports not captured (with -b "*")'),
    ("-c", "--istio-exclude-interfaces", "exclude_interfaces", "", "interfaces never captured"),
    ("-i", "--istio-service-cidr", "outbound_cidrs", "", 'outbound CIDRs to capture; "*" = all, empty = none'),
    ("-x", "--istio-service-exclude-cidr", "outbound_exclude_cidrs", "", "outbound CIDRs not captured"),
    ("-q", "--istio-outbound-ports", "outbound_ports", "", "outbound ports always captured"),
    ("-o", "--istio-local-outbound-ports-exclude", "outbound_exclude_ports", "", "outbound ports not captured"),
    ("-k", "--kube-virt-interfaces", "reroute_interfaces", "", "interfaces whose inbound is treated as outbound"),
    ("-t", "--istio-inbound-tproxy-mark", "tproxy_mark", "1337", "TPROXY packet mark"),
    ("-r", "--istio-inbound-tproxy-route-table", "tproxy_route_table", "133", "TPROXY policy-routing table"),
    (None, "--network-namespace", None, "", "netns to configure (name, path); default: the current one"),
    (None, "--force-iptables-binary", None, "", "iptables binary to use: iptables-legacy or iptables-nft"),
    (None, "--iptables-probe-port", None, "15002", "port used by --run-validation"),
    (None, "--probe-timeout", None, "5s", "how long --run-validation waits (5s, 500ms, 1m; at most 10m)"),
]

#: (flag, RedirectConfig field or None, env var providing the default)
BOOL_FLAGS: list[tuple[str, str | None, str | None, str]] = [
    ("--redirect-dns", "dns_capture", "ISTIO_META_DNS_CAPTURE", "capture DNS to port 53 (to 15053)"),
    ("--capture-all-dns", "capture_all_dns", None, "capture DNS to every server, not only those in resolv.conf"),
    ("--drop-invalid", "drop_invalid", "INVALID_DROP", "drop conntrack-INVALID packets"),
    ("--dual-stack", None, "ISTIO_AGENT_DUAL_STACK", "IPv6 rules too (redirect adds them whenever IPv6 is on)"),
    ("--cleanup-only", None, None, "remove our rules and exit"),
    ("--reconcile", None, None, "replace rules that differ (redirect always reconciles atomically)"),
    ("--native-nftables", None, None, "use the nftables backend"),
    ("--run-validation", None, None, "after setup, prove with a real connection that capture works"),
    ("--skip-rule-apply", None, None, "do not install anything (with --run-validation: only validate)"),
]

DEFAULT_PROXY_UID = "1337"


@dataclass(frozen=True)
class InitOptions:
    """What ``redirect init`` should do, beyond the capture config."""

    config: RedirectConfig
    netns: str | None
    dry_run: bool
    cleanup_only: bool
    skip_rule_apply: bool
    run_validation: bool
    probe_port: int
    probe_timeout: float
    backend: str


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add istio-iptables' flags to ``p`` (defaults resolved later, so env vars apply)."""
    for short, long, _field, _default, help_ in STRING_FLAGS:
        names = [short, long] if short else [long]
        p.add_argument(*names, dest=_dest(long), default=None, metavar="VALUE", help=f"{help_} (${_env_name(long)})")
    for long, _field, env_default, help_ in BOOL_FLAGS:
        extra = f" (${env_default})" if env_default else ""
        p.add_argument(long, dest=_dest(long), action="store_const", const="true", default=None, help=help_ + extra)
    p.add_argument("-n", "--dry-run", dest="dry_run", action="store_const", const="true", default=None,
                   help="print the rules instead of installing them ($DRY_RUN)")


def _dest(long: str) -> str:
    return long.lstrip("-").replace("-", "_")


def _env_name(long: str) -> str:
    return long.lstrip("-").replace("-", "_").upper()


_DURATION = re.compile(r"([0-9]{1,6}(?:\.[0-9]{1,6})?)(ms|s|m)?")
MAX_PROBE_TIMEOUT = 600.0


def _duration(name: str, value: str) -> float:
    """A duration like ``5s``, ``500ms``, ``1m`` or ``2`` (seconds): ASCII digits, up to 10 minutes."""
    m = _DURATION.fullmatch(value.strip())
    if m is None:
        raise ConfigError(name, value, "expected a duration like 5s or 500ms")
    seconds = float(m[1]) * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m[2]]
    if not 0 < seconds <= MAX_PROBE_TIMEOUT:
        raise ConfigError(name, value, f"expected a duration above 0 and at most {MAX_PROBE_TIMEOUT:g}s")
    return seconds


def _truthy(name: str, value: str) -> bool:
    s = value.strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(name, value, "expected true or false")


def options_from_args(ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> InitOptions:
    """Resolve flags, then env vars, then Istio's defaults, into ``InitOptions``."""
    env = os.environ if env is None else env
    raw: dict[str, str] = {}
    for _short, long, _field, default, _help in STRING_FLAGS:
        given: str | None = getattr(ns, _dest(long), None)
        raw[long] = given if given is not None else env.get(_env_name(long), default)
    flags: dict[str, bool] = {}
    for long, _field, env_default, _help in BOOL_FLAGS:
        v = getattr(ns, _dest(long), None)
        if v is None:
            v = env.get(_env_name(long)) or (env.get(env_default) if env_default else None) or "false"
        flags[long] = _truthy(long, v)
    dry = getattr(ns, "dry_run", None) or env.get("DRY_RUN") or "false"

    kwargs: dict[str, Any] = {}
    for _short, long, field, _default, _help in STRING_FLAGS:
        if field is None:
            continue
        value = raw[long]
        kwargs[field] = value
    if not raw["--proxy-uid"]:
        kwargs["proxy_uids"] = _default_proxy_uid(env)
    if not raw["--proxy-gid"]:
        kwargs["proxy_gids"] = kwargs["proxy_uids"]
    kwargs["inbound_interception"] = raw["--istio-inbound-interception-mode"] or "REDIRECT"
    for long, field, _env, _help in BOOL_FLAGS:
        if field is not None:
            kwargs[field] = flags[long]
    if env.get("ISTIO_OUTBOUND_OWNER_GROUPS"):
        kwargs["owner_groups"] = env["ISTIO_OUTBOUND_OWNER_GROUPS"]
    if env.get("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE"):
        kwargs["owner_groups_exclude"] = env["ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE"]
    if env.get("ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR"):
        kwargs["ipv4_loopback_cidr"] = env["ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR"]
    if kwargs.get("dns_capture"):
        # istio-iptables' hairpin rule for proxy gids leaves only the tunnel port alone, DNS or not.
        kwargs["gid_hairpin_skips_dns"] = False
    if kwargs.get("dns_capture") and not kwargs.get("capture_all_dns"):
        kwargs["dns_servers"] = resolv_conf_servers(env.get("REDIRECT_RESOLV_CONF", "/etc/resolv.conf"))
    # Istio: the exclude lists only apply when capturing all; "*" in the exclude CIDRs is rejected.
    if raw["--istio-service-exclude-cidr"].strip() == "*":
        raise ConfigError("--istio-service-exclude-cidr", "*", "invalid value: cannot exclude every CIDR")
    try:
        cfg = RedirectConfig(**kwargs)
    except ConfigError as e:
        raise ConfigError(_flag_for(e.field), e.value, e.reason) from None

    forced = raw["--force-iptables-binary"].strip()
    if flags["--native-nftables"]:
        backend = "nftables"
    elif forced:
        variant = {"iptables-legacy": "legacy", "iptables-nft": "nft", "iptables": ""}.get(os.path.basename(forced))
        if variant is None:
            raise ConfigError("--force-iptables-binary", forced, "expected iptables, iptables-legacy or iptables-nft")
        backend = f"iptables-{variant}" if variant else "iptables"
    else:
        backend = "iptables"
    probe = raw["--iptables-probe-port"].strip()
    probe_port = int(probe) if re.fullmatch(r"[0-9]{1,5}", probe) else 0  # ASCII digits only
    if not 1 <= probe_port <= 65535:
        raise ConfigError("--iptables-probe-port", raw["--iptables-probe-port"], "not a port (1-65535)")
    return InitOptions(
        config=cfg,
        netns=raw["--network-namespace"] or None,
        dry_run=_truthy("--dry-run", dry),
        cleanup_only=flags["--cleanup-only"],
        skip_rule_apply=flags["--skip-rule-apply"],
        run_validation=flags["--run-validation"],
        probe_port=probe_port,
        probe_timeout=_duration("--probe-timeout", raw["--probe-timeout"]),
        backend=backend,
    )


def _flag_for(field: str) -> str:
    for _short, long, f, _default, _help in STRING_FLAGS:
        if f == field:
            return long
    for long, f, _env, _help in BOOL_FLAGS:
        if f == field:
            return long
    return field


def _default_proxy_uid(env: Mapping[str, str]) -> str:
    import pwd

    try:
        return str(pwd.getpwnam(env.get("ENVOY_USER", "istio-proxy")).pw_uid)
    except (KeyError, ValueError):
        return DEFAULT_PROXY_UID


#: How much of resolv.conf is read (glibc uses at most 3 nameservers anyway).
MAX_RESOLV_CONF = 64 * 1024


def resolv_conf_servers(path: str = "/etc/resolv.conf") -> tuple[str, ...]:
    """The ``nameserver`` addresses of a resolv.conf (empty if it can't be read)."""
    import ipaddress

    out: list[str] = []
    try:  # bounded and never fatal: a resolv.conf that is huge or not UTF-8 gives what it can
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f.read(MAX_RESOLV_CONF).splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    try:
                        out.append(str(ipaddress.ip_address(parts[1].split("%")[0])))
                    except ValueError:
                        continue
    except OSError:
        pass
    return tuple(out)


def config_from_istio_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> RedirectConfig:
    """``RedirectConfig`` for an ``istio-iptables`` command line (flags only, no action)."""
    p = argparse.ArgumentParser(prog="istio-iptables", add_help=False, exit_on_error=False)
    add_arguments(p)
    try:
        ns, extra = p.parse_known_args(list(argv))
    except argparse.ArgumentError as e:
        raise ConfigError("argv", " ".join(argv), str(e)) from None
    if extra:
        raise ConfigError("argv", " ".join(extra), "unknown istio-iptables flag(s)")
    return options_from_args(ns, env).config
