"""The ``redirect`` command line.

    redirect setup NETNS [--config FILE] [--set FIELD=VALUE ...] [--backend B] [--dry-run] [--allow-host-netns]
    redirect teardown NETNS [--backend B] [--allow-host-netns]   (no --backend: whatever of ours is installed)
    redirect check NETNS [--config FILE] [--set ...] [--backend B] [--json]
    redirect show NETNS [--backend B] [--json]
    redirect init [istio-iptables flags]      (drop-in for istio-iptables)
    redirect wait [--url URL] [--netns NS] [--timeout S] [--period-ms N]   (a postStart hook)
    redirect inject [-f FILE|-] [--image IMG] [--proxy-image IMG] [--hold-application]
    redirect node setup|check|teardown|add-pod|remove-pod|list-pods   (ambient node probe rules)

NETNS is ``pid:N`` (process N's netns), a path (anything with a ``/``: ``/proc/42/ns/net``,
``./ns``), or a name under /run/netns (a bare number too: ``1`` is /run/netns/1).

Exit codes: 0 ok, 2 bad configuration or usage, 1 failure (nothing was left half-installed).
Imports are lazy so that a per-pod exec (``redirect init``) starts fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..config import int_arg, seconds_arg
from ..version import VersionAction
from . import ebpf as ebpf_commands
from . import node as node_commands

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_CONFIG = 2
EXIT_VALIDATION = 126  # istio-iptables' validation error code

BACKEND_HELP = ("iptables, iptables-legacy, iptables-nft, nftables, ebpf or auto "
                "(default: $REDIRECT_BACKEND, else iptables)")

#: Subcommand groups of their own modules, each with register(subparsers).
SUBCOMMAND_GROUPS = (node_commands, ebpf_commands)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-f", metavar="FILE", help="RedirectConfig as JSON or YAML (field names as keys)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="FIELD=VALUE",
                   help="set one config field (repeatable), e.g. --set outbound_exclude_ports=22,80")
    p.add_argument("--mode", choices=("sidecar", "ambient"), help="shorthand for --set mode=...")


NETNS_HELP = ("network namespace: pid:N (process N's), a path (anything with a '/', e.g. /proc/42/ns/net), "
              "or a name under /run/netns (a bare number is a name too)")
ANY_BACKEND_HELP = ("only this backend's capture (default: whatever of ours is installed, by any backend: "
                    "iptables, nftables or ebpf)")


def _netns_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("netns", help=NETNS_HELP)


def _backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", "-b", default=os.environ.get("REDIRECT_BACKEND", "iptables"), help=BACKEND_HELP)


def _any_backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", "-b", default=None, help=ANY_BACKEND_HELP)


def _host_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-host-netns", action="store_true",
                   help="allow capture in the host's own network namespace (the initial one, pid 1's, or this "
                        "process's own); refused without it")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="redirect",
        description="Capture a pod network namespace's traffic and hand it to a local proxy "
                    "(Istio-compatible sidecar and ambient modes).",
        epilog="Exit codes: 0 ok, 2 bad configuration, 1 failure. "
               "See docs/api.md for the config fields and docs/backends.md for the backends.",
    )
    p.add_argument("--version", action=VersionAction)
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: rule payloads)")
    p.add_argument("--log-json", action="store_true",
                   help="log as JSON lines on stderr: time, level, logger, msg and the pod's fields "
                        "(POD_NAME, POD_NAMESPACE, POD_UID from the environment; the netns)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("setup", help="install redirection in a netns (atomic, idempotent)")
    _netns_arg(s)
    _config_args(s)
    _backend_arg(s)
    _host_arg(s)
    s.add_argument("--dry-run", "-n", action="store_true", help="print the rules; touch nothing")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_setup)

    t = sub.add_parser("teardown", help="remove our redirection from a netns, by any backend (nothing else)")
    _netns_arg(t)
    _any_backend_arg(t)
    _host_arg(t)
    t.set_defaults(func=cmd_teardown)

    c = sub.add_parser("check", help="compare what is installed (by any backend) with a config; exit 1 on drift")
    _netns_arg(c)
    _config_args(c)
    _any_backend_arg(c)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check)

    w = sub.add_parser("show", help="what of ours is installed in a netns, and by which backend")
    _netns_arg(w)
    _any_backend_arg(w)
    w.add_argument("--json", action="store_true")
    w.set_defaults(func=cmd_show)

    i = sub.add_parser(
        "init",
        help="drop-in for istio-iptables: same flags and env vars",
        description="Install sidecar capture from istio-iptables flags (env vars as fallbacks), "
                    "in the current netns or --network-namespace/--netns.",
    )
    from ..istio.flags import add_arguments

    add_arguments(i)
    i.add_argument("--netns", dest="netns_alias", metavar="NETNS", help="same as --network-namespace")
    _host_arg(i)
    i.set_defaults(func=cmd_init)

    wt = sub.add_parser(
        "wait",
        help="wait until the proxy answers (and capture in a netns checks ok); for a postStart hook",
        description="Return 0 once GET --url answers 200 and, with --netns, the capture installed there equals "
                    "the config (as `check` compares it; needs CAP_NET_ADMIN there), in one round; "
                    "exit 1 naming what was not ready after --timeout. Istio's `pilot-agent wait`.",
    )
    wt.add_argument("--url", default=None, metavar="URL",
                    help="http:// URL that answers 200 when the proxy is ready; '' = none "
                         "(default http://localhost:15020/healthz/ready, or none with --netns)")
    wt.add_argument("--netns", default=None, metavar="NETNS", help="also wait for capture in this netns")
    _config_args(wt)
    _any_backend_arg(wt)
    wt.add_argument("--validate", action="store_true",
                    help="with --netns, also run init's validation probe (listens on the inbound port: "
                         "before the proxy does)")
    wt.add_argument("--probe-port", type=int_arg(1, 65535), default=15002,
                    help="port of the validation probe (%(default)s)")
    wt.add_argument("--timeout", type=seconds_arg(0, 86400), default=60.0, metavar="S",
                    help="give up after S seconds (%(default)s)")
    wt.add_argument("--period-ms", type=int_arg(1, 3_600_000), default=500, metavar="N",
                    help="check every N ms (%(default)s)")
    wt.set_defaults(func=cmd_wait)

    j = sub.add_parser(
        "inject",
        help="add sidecar capture to pod specs (Pod, Deployment, StatefulSet, DaemonSet, Job, ...), offline",
        description="Read Kubernetes objects (a YAML stream or JSON) and write them with an init container "
                    "running `redirect init` (flags from the pod's Istio annotations; the only container with "
                    "NET_ADMIN/NET_RAW) and, with --proxy-image, a proxy container running as the proxy "
                    "uid/gid. Objects without a pod template pass through. Idempotent.",
    )
    j.add_argument("-f", "--filename", default="-", metavar="FILE", help="input file, - for stdin (default)")
    j.add_argument("--mode", default="sidecar", help="sidecar (ambient pods need no injection)")
    j.add_argument("--image", default=None, metavar="IMG", help="image of the init container (redirect:0.1.0)")
    j.add_argument("--proxy-image", default=None, metavar="IMG", help="add a proxy container with this image")
    j.add_argument("--hold-application", action="store_true",
                   help="proxy container first, with a postStart `redirect wait` hook: the app starts once the "
                        "proxy is ready (its image must carry redirect)")
    j.add_argument("--ready-url", default=None, metavar="URL",
                   help="what the hook waits for (http://localhost:15020/healthz/ready)")
    j.add_argument("--wait-timeout", type=seconds_arg(0, 86400), default=60.0, metavar="S",
                   help="the hook's --timeout (%(default)s)")
    j.add_argument("--backend", default="iptables", help="backend of `redirect init`: iptables (default), "
                                                          "iptables-legacy, iptables-nft or nftables")
    j.add_argument("--inject-log-json", dest="inject_log_json", action="store_true",
                   help="the injected redirect commands log JSON lines (--log-json)")
    j.set_defaults(func=cmd_inject)

    for group in SUBCOMMAND_GROUPS:
        group.register(sub)
    return p


def _load_config(args: argparse.Namespace) -> Any:
    from ..config import RedirectConfig
    from ..errors import ConfigError

    data: dict[str, Any] = {}
    if args.config:
        data.update(RedirectConfig.from_file(args.config).to_dict())
    if getattr(args, "mode", None):
        data["mode"] = args.mode
    for item in args.sets:
        if "=" not in item:
            raise ConfigError("--set", item, "expected FIELD=VALUE")
        k, v = item.split("=", 1)
        data[k.strip()] = _parse_value(v)
    return RedirectConfig.from_dict(data) if data else RedirectConfig()


def _parse_value(v: str) -> Any:
    s = v.strip()
    if s.startswith(("[", "{", '"')):
        try:
            return json.loads(s)
        except (ValueError, RecursionError):  # not JSON (or nested too deeply): the text itself
            return s
    return s


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def cmd_setup(args: argparse.Namespace) -> int:
    import redirect

    cfg = _load_config(args)
    if args.dry_run:
        sys.stdout.write(redirect.render(cfg, backend=args.backend))
        return EXIT_OK
    res = redirect.setup(args.netns, cfg, backend=args.backend, allow_host_netns=args.allow_host_netns)
    if args.json:
        _print_json({"backend": res.backend, "netns": res.netns, "families": list(res.families),
                     "changed": res.changed, "detail": res.detail})
    else:
        fams = "+".join(f"IPv{f}" for f in res.families)
        print(f"{res.netns}: {cfg.mode} capture {'installed' if res.changed else 'already in place'} "
              f"({res.backend}, {fams})")
    return EXIT_OK


def cmd_teardown(args: argparse.Namespace) -> int:
    import redirect

    removed = redirect.teardown(args.netns, backend=args.backend, allow_host_netns=args.allow_host_netns)
    print(f"{args.netns}: {'removed' if removed else 'nothing of ours was installed'}")
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    import redirect

    cfg = _load_config(args)
    res = redirect.check(args.netns, cfg, backend=args.backend)
    if args.json:
        _print_json({"ok": res.ok, "backend": res.backend, "differences": list(res.differences)})
    elif res.ok:
        print(f"{args.netns}: installed rules match the config ({res.backend})")
    else:
        print(f"{args.netns}: {len(res.differences)} difference(s) ({res.backend}):")
        for d in res.differences:
            print(f"  {d}")
    return EXIT_OK if res.ok else EXIT_FAIL


def cmd_show(args: argparse.Namespace) -> int:
    import redirect

    info = redirect.show(args.netns, backend=args.backend)
    if args.json:
        _print_json(info)
        return EXIT_OK
    if info.get("installed"):
        print(f"netns {info['netns']}: redirection installed by the {info.get('backend')} backend")
    elif args.backend:
        print(f"netns {info['netns']}: no capture of ours by the {info.get('backend')} backend")
    else:
        print(f"netns {info['netns']}: nothing of ours installed (by any backend)")
    _print_details(info)
    for other, details in info.get("also_installed", {}).items():
        print(f"netns {info['netns']}: also installed by the {other} backend (an interrupted switch: a setup "
              f"replaces it, teardown removes it)")
        _print_details(details)
    return EXIT_OK


def _print_details(info: dict[str, Any]) -> None:
    for variant, fams in info.get("variants", {}).items():
        for fam, tables in fams.items():
            for table, st in tables.items():
                print(f"  [{variant} {fam} {table}]")
                for j in st["jumps"]:
                    print(f"    {j}")
                for rules in st["chains"].values():
                    for r in rules:
                        print(f"    {r}")
    for key in ("routes", "addresses"):
        for item in info.get(key, []):
            print(f"  {key[:-1]}: {item}")
    for key, value in info.items():
        if key not in ("netns", "backend", "backends", "installed", "variants", "routes", "addresses",
                       "also_installed"):
            print(f"  {key}: {json.dumps(value, default=str)}")


def cmd_init(args: argparse.Namespace) -> int:
    import redirect

    from ..istio.flags import options_from_args

    if args.netns_alias:
        args.network_namespace = args.netns_alias
    opts = options_from_args(args)
    log = logging.getLogger("redirect.init")
    log.info("istio-iptables config: %s", json.dumps(opts.config.to_dict(), sort_keys=True))
    target = opts.netns or "/proc/self/ns/net"
    if opts.dry_run:
        sys.stdout.write(redirect.render(opts.config, backend=opts.backend))
        return EXIT_OK
    allow_host = args.allow_host_netns
    if not opts.netns and not allow_host and (opts.cleanup_only or not opts.skip_rule_apply):
        _refuse_init_on_host(target)
        allow_host = True  # its own netns: what istio-iptables works in (inside the pod)
    if opts.cleanup_only:
        removed = redirect.teardown(target, backend=opts.backend, allow_host_netns=allow_host)
        print("removed redirect rules" if removed else "nothing of ours was installed")
        return EXIT_OK
    if opts.run_validation:
        from ..errors import SetupError
        from ..istio.validation import cannot_validate

        why = cannot_validate(opts.config)
        if why is not None:  # said before anything is installed
            raise SetupError(why)
    if not opts.skip_rule_apply:
        res = redirect.setup(target, opts.config, backend=opts.backend, allow_host_netns=allow_host)
        print(f"{'installed' if res.changed else 'already in place'}: sidecar capture ({res.backend}, "
              f"{'+'.join(f'IPv{f}' for f in res.families)})")
    if opts.run_validation:
        from ..istio.validation import validate_outbound

        ok, msg = validate_outbound(target, opts.config, opts.probe_port, opts.probe_timeout)
        print(msg)
        if not ok:
            return EXIT_VALIDATION
    return EXIT_OK


def _refuse_init_on_host(target: str) -> None:
    """``redirect init`` without a netns installs in (or, ``--cleanup-only``, removes from) its own,
    as istio-iptables does inside the pod; that own netns must still not be the host's (initial
    or pid 1's)."""
    from ..errors import HostNetnsError
    from ..kernel.netns import enter, host_netns_reason

    with enter(target):
        why = host_netns_reason(own_ok=True)
    if why is not None:
        raise HostNetnsError(f"redirect init without --network-namespace works in its own netns, and {why}."
                             " Refused: run it inside the pod, name the pod's netns, or pass --allow-host-netns")


def _pod_netns(args: argparse.Namespace) -> str | None:
    """The pod netns a command works on, for the log lines' ``netns`` field (not the node's)."""
    if args.command == "init":
        return getattr(args, "netns_alias", None) or getattr(args, "network_namespace", None)
    return getattr(args, "netns", None) if args.command in ("setup", "teardown", "check", "show", "wait") else None


def cmd_wait(args: argparse.Namespace) -> int:
    from .. import wait

    url = args.url if args.url is not None else (None if args.netns else wait.DEFAULT_URL)
    cfg = _load_config(args) if args.netns else None
    res = wait.wait(url=url or None, netns=args.netns, config=cfg, backend=args.backend, timeout=args.timeout,
                    period=args.period_ms / 1000, validate=args.validate, probe_port=args.probe_port)
    what = " and ".join(x for x in (f"capture in {args.netns}" if args.netns else "", url or "") if x)
    if res.ok:
        logging.getLogger("redirect.wait").info("ready after %.2f s (%d rounds)", res.seconds, res.rounds)
        print(f"ready: {what} ({res.seconds:.2f} s)")
        return EXIT_OK
    _error(args, f"redirect: wait: not ready after {res.seconds:.1f} s: {res.reason}")
    return EXIT_FAIL


def cmd_inject(args: argparse.Namespace) -> int:
    from ..config import read_regular_file
    from ..errors import ConfigError
    from ..k8s import inject

    opts = inject.InjectOptions(image=args.image or inject.DEFAULT_IMAGE, proxy_image=args.proxy_image,
                                hold_application=args.hold_application, backend=args.backend,
                                ready_url=args.ready_url or inject.READY_URL, wait_timeout=args.wait_timeout,
                                log_json=args.inject_log_json, mode=args.mode)
    try:
        if args.filename == "-":
            text = sys.stdin.read(inject.MAX_INPUT + 1)
        else:
            raw = read_regular_file(args.filename, inject.MAX_INPUT + 1)
            # (too long: decoded leniently, so that the size check below names the problem)
            text = raw.decode("utf-8", "strict" if len(raw) <= inject.MAX_INPUT else "replace")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise ConfigError("--filename", args.filename, f"cannot be read: {why}") from None
    notes: list[str] = []
    out = inject.inject_text(text, opts, notes)
    for note in notes:
        logging.getLogger("redirect.inject").warning("%s", note)
    sys.stdout.write(out)
    return EXIT_OK


def _setup_logging(verbose: int, as_json: bool, netns: str | None = None) -> None:
    from .. import logjson

    pod = {**logjson.pod_fields_from_env(), **logjson.pod_fields(netns=netns)}
    logjson.setup(json_lines=as_json, level=logging.DEBUG if verbose >= 2 else (logging.INFO if verbose else
                  logging.WARNING), pod=pod, text_format="redirect: %(levelname)s %(message)s")


def _error(args: argparse.Namespace, text: str) -> None:
    """The failure line on stderr: as is, or (``--log-json``) as one JSON log line at level error."""
    if args.log_json:
        logging.getLogger("redirect.cli").error(text.removeprefix("redirect: "))
    else:
        print(text, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    from ..errors import BackendUnavailable, ConfigError, NetnsError, RedirectError

    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose, args.log_json, _pod_netns(args))
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ConfigError as e:
        _error(args, f"redirect: bad configuration: {e}")
        return EXIT_CONFIG
    except NetnsError as e:
        _error(args, f"redirect: {e}")
        return EXIT_FAIL
    except BackendUnavailable as e:
        _error(args, f"redirect: backend unavailable: {e}")
        return EXIT_FAIL
    except RedirectError as e:
        _error(args, f"redirect: failed: {e}")
        return EXIT_FAIL
    except KeyboardInterrupt:
        return 130
