"""A pod's tc filters: ``redirect/bpf/tc_forward.c``'s ingress and egress programs on each interface the
pod forwards on, so that what it forwards is captured as netfilter's inbound capture takes it
(nat PREROUTING's REDIRECT, TPROXY's mangle PREROUTING: they match whatever the destination).

The filters (``native/tc_filter.c``) sit in the interface's clsact qdisc at our priority
(``RDR_TC_PRIO``), run the host's shared programs and carry the pod's pool slot in their classid
(the programs read the pod from it), and whether the setup that made them made the qdisc. They go
on at setup with the pod's other state, in its one native write, before the policy that makes them
capture (``rdr_ebpf_pod_write``), and come off the interfaces no longer wanted after a policy
without them, and at teardown before the pod's slot is released (a filter names the slot; a slot
given to another pod later must not find it). The kernel removes them with the interface, and when
the interface moves to another netns; a clsact qdisc we made goes with our filters when nothing
else is in it, and one that was there stays. A filter not ours at our priority is in the way:
setup fails naming it, ``check`` reports it, and it is left alone.

Which interfaces: those on which the pod forwards when setup runs (IPv4: the interface's
forwarding setting; IPv6: ``all.forwarding``), when its capture takes anything inbound at all
(``takes_forwarded``), less its excluded interfaces (inbound capture never takes what arrives
there). An interface made, or forwarding turned on, after setup is reported by ``check`` and
taken by the next setup.
"""

from __future__ import annotations

import errno
import os
import socket

from ....errors import SetupError
from ....plan.lower_ebpf import CIDR_KIND
from ..abi import CIDR_KEY
from ..host import NATIVE
from .entries import PodEntries

#: Interfaces a pod may forward on (``RDR_FWD_MAX``): more fail its setup.
_MAX = int(NATIVE.lib.RDR_FWD_MAX)


def takes_forwarded(want: PodEntries) -> bool:
    """Whether the pod's capture takes anything inbound (its inbound capture, or a reroute
    interface): only then can it take what the pod forwards."""
    return want.inbound or any(CIDR_KEY.unpack(k)[1] == CIDR_KIND["iface_reroute"] for k in want.cidrs)


def _excluded(cidrs: frozenset[bytes]) -> set[int]:
    out = set()
    for k in cidrs:
        _plen, kind, _netns, addr = CIDR_KEY.unpack(k)
        if kind == CIDR_KIND["iface_exclude"]:
            out.add(int.from_bytes(addr[:4], "big"))
    return out


def forwarding() -> frozenset[int]:
    """The calling thread's netns's interfaces (lo aside) on which it forwards what arrives.
    ``SetupError`` when it forwards on more than ``RDR_FWD_MAX`` (those that do not forward count
    for nothing), or they cannot be read."""
    buf = NATIVE.ffi.new("int[]", _MAX)
    n = NATIVE.lib.rdr_forwarding(buf, _MAX)
    if n == -errno.E2BIG:
        raise SetupError(f"backend=ebpf: the netns forwards on more than {_MAX} interfaces, the most the eBPF"
                         " backend puts its tc filters on; nftables and iptables take any number")
    if n == -errno.EINTR:
        raise SetupError("backend=ebpf: the interfaces' forwarding settings kept changing while they were read"
                         " (every dump of them flagged inconsistent by the kernel): run setup again")
    if n < 0:
        raise SetupError(f"backend=ebpf: read the interfaces' forwarding settings: {os.strerror(-n)}")
    return frozenset(buf[i] for i in range(n))


def wanted(want: PodEntries) -> frozenset[int]:
    """The interfaces of the calling thread's netns that are to have our filters for ``want``."""
    if not takes_forwarded(want):
        return frozenset()
    return forwarding() - _excluded(want.cidrs)


#: An interface's filters of ours (``ours``): ingress program id, its slot, egress program id, its
#: slot (a side without ours: 0, -1), and where a filter not ours sits at our priority (bit 0:
#: ingress, bit 1: egress).
Ours = tuple[int, int, int, int, int]


def ours() -> dict[int, Ours]:
    """Our filters in the calling thread's netns, by ifindex (interfaces with one of ours)."""
    room = _MAX
    while True:  # (more of ours than room: again with room for all)
        buf = NATIVE.ffi.new("struct rdr_tc_filter[]", room)
        n = NATIVE.lib.rdr_tc_list(buf, room)
        if n < 0:
            raise OSError(-n, f"read our tc filters: {os.strerror(-n)}")
        if n <= room:
            break
        room = n

    def slot(prog: int, classid: int) -> int:
        return (classid & 0xFFFF & ~NATIVE.lib.RDR_TC_NO_L2) - 1 if prog else -1

    return {int(f.ifindex): (int(f.prog_in), slot(f.prog_in, f.classid_in), int(f.prog_out),
                             slot(f.prog_out, f.classid_out), int(f.others)) for f in (buf[i] for i in range(n))}


def to_attach(want: frozenset[int], have: dict[int, Ours], progs: tuple[int, int], slot: int | None) -> list[int]:
    """Of ``want``, the interfaces whose filters are missing, not the host's programs with ``slot``
    (None: a slot not claimed yet: all of them), or not alone at our priority (where attaching
    fails, naming what is there)."""
    if slot is None:
        return sorted(want)
    ok = (progs[0], slot, progs[1], slot, 0)
    return sorted(i for i in want if have.get(i) != ok)


def detach(ifindexes: set[int] | frozenset[int]) -> None:
    """Our filters off ``ifindexes`` (and a clsact qdisc we made, when nothing else is in it)."""
    lib = NATIVE.lib
    for idx in sorted(ifindexes):
        rc = lib.rdr_tc_detach(idx)
        if rc < 0 and rc != -errno.ENODEV:
            raise OSError(-rc, f"remove our tc filters from ifindex {idx}: {os.strerror(-rc)}")


def detach_all() -> int:
    """Our filters off every interface of the calling thread's netns: how many had ours."""
    rc = int(NATIVE.lib.rdr_tc_detach_all())
    if rc < 0:
        raise OSError(-rc, f"remove our tc filters: {os.strerror(-rc)}")
    return rc


def differences(want: frozenset[int], have: dict[int, Ours], progs: tuple[int, int], slot: int | None) -> list[str]:
    """What ``check`` reports of the pod's tc filters."""
    names = {i: n for i, n in socket.if_nameindex()}

    def name(i: int) -> str:
        return f"{names.get(i, '?')} (ifindex {i})"

    out = []
    for i in to_attach(want, have, progs, slot):
        mine = have.get(i, (0, -1, 0, -1, 0))
        if mine[:4] != (progs[0], slot, progs[1], slot):
            out.append(f"missing or stale tc filters on {name(i)}, where the pod forwards")
        out += [f"a tc filter that is not ours at our priority {NATIVE.lib.RDR_TC_PRIO} on the {side} of {name(i)}"
                " (left alone: setup fails until it goes)" for bit, side in ((1, "ingress"), (2, "egress"))
                if mine[4] & bit]
    out += [f"unexpected tc filter of ours on {name(i)}" for i in sorted(set(have) - want)]
    return out


def describe(have: dict[int, Ours]) -> list[str]:
    """``show``'s lines for the pod's filters."""
    names = {i: n for i, n in socket.if_nameindex()}
    return [f"{names.get(i, '?')} (ifindex {i}): ingress prog {v[0]} slot {v[1]}, egress prog {v[2]} slot {v[3]}"
            for i, v in sorted(have.items())]


__all__ = ["describe", "detach", "detach_all", "differences", "forwarding", "ours", "takes_forwarded",
           "to_attach", "wanted"]
