"""``redirect node ...``: the node-side probe rules of ambient mode (see :mod:`redirect.ambient.node`).

    redirect node setup   [--netns NS] [--probe-snat-ipv4 A] [--probe-snat-ipv6 A] [--ipv6 auto|on|off]
    redirect node check   [--netns NS] [same options] [--json]     exit 1 on drift
    redirect node teardown [--netns NS]
    redirect node add-pod IP [IP ...] [--owner POD_UID] [--netns NS]
    redirect node remove-pod IP [IP ...] [--owner POD_UID] [--netns NS]
    redirect node list-pods [--netns NS] [--json]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

_IPV6 = {"auto": None, "on": True, "off": False}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--netns", metavar="NETNS", default=None,
                   help="the node's netns (a name, path or pid); default: the current one")


def _cfg_args(p: argparse.ArgumentParser) -> None:
    from ..config import PROBE_SNAT

    p.add_argument("--probe-snat-ipv4", default=None, metavar="ADDR",
                   help=f"source kubelet probes are SNAT'd to (default {PROBE_SNAT[4]})")
    p.add_argument("--probe-snat-ipv6", default=None, metavar="ADDR",
                   help=f"IPv6 probe source (default {PROBE_SNAT[6]})")
    p.add_argument("--ipv6", choices=tuple(_IPV6), default="auto",
                   help="IPv6 rule and set: auto (whenever the netns has IPv6), on or off")


def _config(args: argparse.Namespace) -> Any:
    from ..ambient.node import NodeConfig

    kw: dict[str, Any] = {"ipv6": _IPV6[args.ipv6]}
    if args.probe_snat_ipv4 is not None:
        kw["probe_snat_ipv4"] = args.probe_snat_ipv4
    if args.probe_snat_ipv6 is not None:
        kw["probe_snat_ipv6"] = args.probe_snat_ipv6
    return NodeConfig(**kw)


def _where(args: argparse.Namespace) -> str:
    return args.netns or "current netns"


def cmd_setup(args: argparse.Namespace) -> int:
    from ..ambient import node

    changed = node.setup_node(args.netns, _config(args))
    print(f"{_where(args)}: node probe rules {'installed' if changed else 'already in place'}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from ..ambient import node

    res = node.check_node(args.netns, _config(args))
    if args.json:
        print(json.dumps({"ok": res.ok, "differences": list(res.differences)}, indent=2))
    elif res.ok:
        print(f"{_where(args)}: node probe rules are in place")
    else:
        print(f"{_where(args)}: {len(res.differences)} difference(s):")
        for d in res.differences:
            print(f"  {d}")
    return 0 if res.ok else 1


def cmd_teardown(args: argparse.Namespace) -> int:
    from ..ambient import node

    removed = node.teardown_node(args.netns)
    print(f"{_where(args)}: {'removed' if removed else 'nothing of ours was installed'}")
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    from ..ambient import node

    added = node.add_pods(args.ips, args.netns, owner=args.owner)
    print(f"added {', '.join(added)}" if added else "already present")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    from ..ambient import node

    removed = node.remove_pods(args.ips, args.netns, owner=args.owner)
    print(f"removed {', '.join(removed)}" if removed else "nothing removed")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from ..ambient import node

    pods = node.list_pods(args.netns)
    if args.json:
        print(json.dumps(pods, indent=2, sort_keys=True))
    else:
        for ip, owner in sorted(pods.items()):
            print(f"{ip}\t{owner or '-'}")
    return 0


def register(sub: Any) -> None:
    """Add ``node`` and its subcommands to the ``redirect`` parser."""
    n = sub.add_parser(
        "node", help="ambient mode's node-side rules: SNAT kubelet probes to ambient pods",
        description="Install the host rules that SNAT kubelet health probes to ambient pods to the probe "
                    "address (which the in-pod rules let through), and manage the set of ambient pod IPs "
                    "they match (ipsets rdr-inpod-probes-v4/-v6).",
    )
    nsub = n.add_subparsers(dest="node_command", metavar="NODE_COMMAND")
    nsub.required = True
    s = nsub.add_parser("setup", help="install or re-assert the host rules and sets (idempotent)")
    _common(s)
    _cfg_args(s)
    s.set_defaults(func=cmd_setup)
    c = nsub.add_parser("check", help="compare the installed host rules with what setup makes; exit 1 on drift")
    _common(c)
    _cfg_args(c)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check)
    t = nsub.add_parser("teardown", help="remove our host rules and sets (nothing else)")
    _common(t)
    t.set_defaults(func=cmd_teardown)
    for name, func, text in (("add-pod", cmd_add, "add pod IPs to the probe sets"),
                             ("remove-pod", cmd_remove, "remove pod IPs from the probe sets")):
        a = nsub.add_parser(name, help=text)
        a.add_argument("ips", nargs="+", metavar="IP")
        a.add_argument("--owner", metavar="POD_UID",
                       help="who owns the entries (removal only removes entries with this owner)")
        _common(a)
        a.set_defaults(func=func)
    ls = nsub.add_parser("list-pods", help="the pod IPs in the probe sets, with their owners")
    _common(ls)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)
