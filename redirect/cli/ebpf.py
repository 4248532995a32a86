"""``redirect ebpf ...``: the eBPF backend's host programs (see :mod:`redirect.backends.ebpf`).

    redirect ebpf status [--root DIR] [--json]   exit 1 if the pins are incomplete
    redirect ebpf gc     [--root DIR]            drop pods whose netns went without a teardown
    redirect ebpf unload [--root DIR] [--force]  remove the host programs, maps and cgroup links

The host programs stay loaded (pinned under ``/sys/fs/bpf/redirect`` or ``$REDIRECT_BPF_ROOT``)
after the last pod is torn down, so the next pod's setup needs no compile; ``unload`` removes them.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def _root_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", metavar="DIR", default=None,
                   help="bpffs directory of the host pins (default $REDIRECT_BPF_ROOT or /sys/fs/bpf/redirect)")


def status(root: str | None) -> dict[str, Any]:
    """What is pinned under the root: loaded, missing pins, registered pods (netns cookies)."""
    from ..backends import ebpf, ebpf_root

    r = root or ebpf_root()
    out: dict[str, Any] = {"root": r, "build_id": ebpf.build_id(), "exists": os.path.isdir(r)}
    if not out["exists"]:
        return {**out, "loaded": False, "missing": [], "pods": []}
    missing = ebpf.missing_pins(r)
    out["missing"] = missing
    out["loaded"] = not missing
    out["pods"] = ebpf.registered_pods(r) if not missing else []
    if missing:
        out["pods_count"] = ebpf.count_pods(r)  # None: can't be told without the pods map
    return out


def cmd_status(args: argparse.Namespace) -> int:
    st = status(args.root)
    if args.json:
        print(json.dumps(st, indent=2))
    elif not st["exists"]:
        print(f"{st['root']}: no host programs loaded")
    elif st["loaded"]:
        print(f"{st['root']}: host programs loaded (build {st['build_id']}), {len(st['pods'])} pod(s) registered")
        for c in st["pods"]:
            print(f"  netns cookie {c}")
    else:
        n = st.get("pods_count")
        print(f"{st['root']}: incomplete: missing {', '.join(st['missing'])}; "
              f"{'an unknown number of' if n is None else n} pod(s) registered. The next setup repairs the pins "
              f"(or, with pods registered, says what to do); `redirect ebpf unload --force` removes them")
    return 0 if st["loaded"] or not st["exists"] else 1


def cmd_gc(args: argparse.Namespace) -> int:
    from ..backends import ebpf

    gone = ebpf.collect_garbage(args.root)
    print(f"removed {len(gone)} pod(s) whose netns is gone" + (f": cookies {gone}" if gone else ""))
    return 0


def cmd_unload(args: argparse.Namespace) -> int:
    from ..backends import ebpf, ebpf_root

    r = args.root or ebpf_root()
    removed = ebpf.unload_host(r, force=args.force)
    print(f"{r}: {'host programs, maps and links removed' if removed else 'nothing was loaded'}")
    return 0


def register(sub: Any) -> None:
    """Add ``ebpf`` and its subcommands to the ``redirect`` parser."""
    e = sub.add_parser(
        "ebpf", help="the eBPF backend's host programs: status, gc, unload",
        description="The eBPF backend keeps its programs, maps and cgroup links pinned in bpffs between "
                    "pods. Show them, drop the pods whose network namespace went without a teardown, "
                    "or remove them all.",
    )
    esub = e.add_subparsers(dest="ebpf_command", metavar="EBPF_COMMAND")
    esub.required = True
    s = esub.add_parser("status", help="what is loaded and which pods (netns cookies) are registered; "
                                       "exit 1 if pins are missing")
    _root_arg(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)
    g = esub.add_parser("gc", help="remove the pods whose netns is gone without a teardown")
    _root_arg(g)
    g.set_defaults(func=cmd_gc)
    u = esub.add_parser("unload", help="remove the host programs, maps and cgroup links (refused while pods "
                                       "are registered, unless --force)")
    _root_arg(u)
    u.add_argument("--force", action="store_true",
                   help="remove them even with pods registered (those pods lose capture at once)")
    u.set_defaults(func=cmd_unload)
