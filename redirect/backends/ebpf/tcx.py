"""A pod's tcx links: ``bpf/tc_reroute.c``'s ingress and egress programs on each of its reroute
interfaces (what the pod forwards from them goes to the proxy, as netfilter's nat PREROUTING has
it), pinned at ``<root>/pods/<cookie>-tcx/<ifindex>-in`` and ``-out``.

They are attached before the policy that names the interfaces is written (the programs do nothing
for an interface the policy does not reroute), and removed after a policy without them, with the
pod (``pods._remove_pod``: teardown, garbage collection) and with the host programs. The kernel
detaches them itself when the interface goes (its netns with it); the pins then go with the pod.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable
from typing import Any

from ...errors import BackendUnavailable
from .abi import CIDR_IF_REROUTE, CIDR_KEY
from .syscalls import _check, _detach_pinned, _native, _pinned_link_info, link_create, obj_pin

#: tcx attach types (enum bpf_attach_type, kernel 6.6+: newer than the headers the native module
#: may be built with).
TCX_INGRESS, TCX_EGRESS = 46, 47
#: (pin suffix, the stub's index in tc_prog, attach type)
_DIRECTIONS = (("in", 0, TCX_INGRESS), ("out", 1, TCX_EGRESS))


def tcx_dir(root: str, cookie: int) -> str:
    return os.path.join(root, "pods", f"{cookie}-tcx")


def rerouted_ifindexes(cidrs: Iterable[bytes]) -> frozenset[int]:
    """The interfaces a pod's ``cidrs`` entries reroute (``RDR_CIDR_IF_REROUTE``: ifindex, network order)."""
    out = set()
    for k in cidrs:
        _plen, kind, _netns, addr = CIDR_KEY.unpack(k)
        if kind == CIDR_IF_REROUTE:
            out.add(int.from_bytes(addr[:4], "big"))
    return frozenset(out)


def pins(root: str, cookie: int) -> dict[int, set[str]]:
    """The pod's pinned tcx links, attached or not: ifindex -> the directions ("in", "out")."""
    out: dict[int, set[str]] = {}
    try:
        names = os.listdir(tcx_dir(root, cookie))
    except FileNotFoundError:
        return out
    for n in names:
        idx, _, d = n.partition("-")
        if idx.isdigit():
            out.setdefault(int(idx), set()).add(d)
    return out


def _attached(root: str, cookie: int, idx: int, suffix: str) -> bool:
    """Whether the pin is a link attached to ifindex ``idx`` (the kernel detaches it when the
    interface goes: an interface made again with the same ifindex has none)."""
    info = _pinned_link_info(os.path.join(tcx_dir(root, cookie), f"{idx}-{suffix}"))
    return info is not None and info["target"] == idx


def pinned(root: str, cookie: int) -> dict[int, set[str]]:
    """The pod's tcx links attached to their interfaces: ifindex -> the directions ("in", "out")."""
    out: dict[int, set[str]] = {}
    for idx, dirs in pins(root, cookie).items():
        for d in dirs:
            if _attached(root, cookie, idx, d):
                out.setdefault(idx, set()).add(d)
    return out


def attach(maps: dict[str, Any], root: str, cookie: int, ifindexes: Iterable[int]) -> list[str]:
    """Attach and pin, in the calling thread's netns, the links ``ifindexes`` lack, each running a
    stub that holds ``cookie`` (``rdr_ebpf_tc_stub``); the pins made (``undo`` takes them back). On
    ``OSError`` (the kernel refused one; ``BackendUnavailable`` if it has no tcx) the pins made are
    undone."""
    made: list[str] = []
    have = pinned(root, cookie)
    d = tcx_dir(root, cookie)
    try:
        for idx in sorted(ifindexes):
            for suffix, index, attach_type in _DIRECTIONS:
                if suffix in have.get(idx, ()):
                    continue
                _detach_pinned(os.path.join(d, f"{idx}-{suffix}"))  # a detached one left pinned
                os.makedirs(d, exist_ok=True)
                stub = _check(_native().lib.rdr_ebpf_tc_stub(maps["tc_netns"].fd, maps["tc_prog"].fd, cookie, index),
                              "load the tcx stub")
                try:
                    fd = link_create(stub, idx, attach_type)
                except OSError as e:
                    if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # no tcx: nothing was installed
                        raise BackendUnavailable(f"ebpf: reroute_interfaces needs tcx links (kernel 6.6+): {e}"
                                                 ) from None
                    raise
                finally:
                    os.close(stub)  # (the link holds it)
                try:
                    path = os.path.join(d, f"{idx}-{suffix}")
                    obj_pin(fd, path)
                    made.append(path)
                finally:
                    os.close(fd)  # (pinned, the link stays)
    except BaseException:
        undo(root, cookie, made)
        raise
    return made


def undo(root: str, cookie: int, paths: Iterable[str]) -> None:
    """Detach and unpin ``paths`` (what ``attach`` made); the pod's directory goes if left empty."""
    for p in paths:
        _detach_pinned(p)
    with contextlib.suppress(OSError):
        os.rmdir(tcx_dir(root, cookie))


def detach(root: str, cookie: int, keep: Iterable[int] = ()) -> bool:
    """Detach and unpin the pod's tcx links but those of ``keep``; True if any was there."""
    keep = set(keep)
    d = tcx_dir(root, cookie)
    removed = False
    for idx, dirs in pins(root, cookie).items():
        if idx in keep:
            continue
        for suffix in dirs:
            _detach_pinned(os.path.join(d, f"{idx}-{suffix}"))
            removed = True
    with contextlib.suppress(OSError):  # (not empty: links of keep)
        os.rmdir(d)
    return removed


def differences(root: str, cookie: int, want: frozenset[int]) -> list[str]:
    """What ``check`` reports of the pod's tcx links against the interfaces it reroutes."""
    have = pinned(root, cookie)
    out = [f"missing tcx link ({suffix}) on ifindex {idx}" for idx in sorted(want)
           for suffix, _p, _a in _DIRECTIONS if suffix not in have.get(idx, ())]
    out += [f"unexpected tcx link on ifindex {idx}" for idx in sorted(set(pins(root, cookie)) - want)]
    return out


__all__ = ["TCX_EGRESS", "TCX_INGRESS", "attach", "detach", "differences", "pinned", "pins", "rerouted_ifindexes",
           "tcx_dir", "undo"]
