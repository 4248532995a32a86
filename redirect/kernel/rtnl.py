"""A small rtnetlink client over a raw ``NETLINK_ROUTE`` socket: dump links, rules, routes and
addresses, and add or delete the few of them a plan needs (local addresses, a local default
route, fwmark rules).

It is the one netlink module of the per-setup path (``redirect.kernel.routes``, hence every setup,
check and teardown, the CNI plugin and ``redirect init``): importing pyroute2 takes long enough
to dominate a short-lived process that sets up one pod, and this needs only the standard
library. Long-lived processes that need richer netlink (the agent's ipset reads, the tests'
namespaces and veths) use pyroute2. Acts on the netns of the calling thread (the socket is
opened there).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

NETLINK_ROUTE = 0
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_GETLINK, RTM_GETADDR, RTM_GETROUTE, RTM_GETRULE = 18, 22, 26, 34

# attribute numbers (linux/fib_rules.h, rtnetlink.h, if_addr.h, if_link.h)
FRA_PRIORITY, FRA_FWMARK, FRA_TABLE, FRA_FWMASK, FRA_PROTOCOL = 6, 10, 15, 16, 21
RTA_OIF, RTA_TABLE = 4, 15
IFA_ADDRESS, IFA_PROTO = 1, 11
IFLA_IFNAME, IFLA_AF_SPEC = 3, 26
IFLA_INET6_CONF = 2
DEVCONF_DISABLE_IPV6 = 26  # index in IFLA_INET6_CONF's array of s32 (linux/ipv6.h)

_HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_ATTR = struct.Struct("=HH")


@dataclass
class Msg:
    """One dumped object: its fixed header fields and its attributes (raw bytes)."""

    family: int
    fields: tuple[int, ...]
    attrs: dict[int, bytes] = field(default_factory=dict)

    def u32(self, attr: int) -> int | None:
        v = self.attrs.get(attr)
        return None if v is None else int(struct.unpack("=I", v[:4])[0])

    def u8(self, attr: int) -> int | None:
        v = self.attrs.get(attr)
        return None if v is None else v[0]


# request body and the struct of the reply's fixed part, per message type
_BODY = {
    RTM_GETRULE: ("=BBBBBBBBI", 12),  # fib_rule_hdr: family dst_len src_len tos table res1 res2 action flags
    RTM_GETROUTE: ("=BBBBBBBBI", 12),  # rtmsg: family dst_len src_len tos table protocol scope type flags
    RTM_GETADDR: ("=BBBBI", 8),  # ifaddrmsg: family prefixlen flags scope index
    RTM_GETLINK: ("=BxHiII", 16),  # ifinfomsg: family type index flags change
}


def open_socket() -> socket.socket:
    """A NETLINK_ROUTE socket in the calling thread's netns, for several ``dump``/``request`` calls."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE)
    try:
        s.settimeout(5)
        s.bind((0, 0))
    except BaseException:
        s.close()
        raise
    return s


@contextlib.contextmanager
def _socket(given: socket.socket | None) -> Iterator[socket.socket]:
    if given is not None:
        yield given
        return
    s = open_socket()
    try:
        yield s
    finally:
        s.close()


_seq = itertools.count(1)


def dump(kind: int, family: int = socket.AF_UNSPEC, sock: socket.socket | None = None) -> list[Msg]:
    """Every object of ``kind`` (RTM_GET*) of ``family``; on ``sock`` if given (else a socket of its own)."""
    fmt, size = _BODY[kind]
    body = struct.pack(fmt, family, *([0] * (len(struct.unpack(fmt, bytes(size))) - 1)))
    with _socket(sock) as s:
        seq = next(_seq) & 0xFFFFFFFF
        s.send(_HDR.pack(_HDR.size + len(body), kind, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body)
        out: list[Msg] = []
        while True:
            data = s.recv(1 << 16)
            off = 0
            while off + _HDR.size <= len(data):
                length, mtype, _flags, mseq, _pid = _HDR.unpack_from(data, off)
                if length < _HDR.size:
                    return out
                if mseq == seq:
                    if mtype == NLMSG_DONE:
                        return out
                    if mtype == NLMSG_ERROR:
                        err = -struct.unpack_from("=i", data, off + _HDR.size)[0]
                        if err:
                            raise OSError(err, os.strerror(err))
                        return out
                    payload = data[off + _HDR.size : off + length]
                    fixed = struct.unpack_from(fmt, payload, 0)
                    out.append(Msg(fixed[0], tuple(fixed[1:]), parse_attrs(payload[(size + 3) & ~3 :])))
                off += (length + 3) & ~3


def parse_attrs(buf: bytes) -> dict[int, bytes]:
    """Netlink attributes (type, NLA_F_NESTED cleared -> payload) of ``buf``: a nested attribute's payload."""
    out: dict[int, bytes] = {}
    a = 0
    while a + _ATTR.size <= len(buf):
        alen, atype = _ATTR.unpack_from(buf, a)
        if alen < _ATTR.size:
            break
        out[atype & 0x3FFF] = buf[a + _ATTR.size : a + alen]
        a += (alen + 3) & ~3
    return out


def _exchange(sock: socket.socket | None, kind: int, flags: int, payload: bytes) -> tuple[int, bytes]:
    """Send one (non-dump) request; its reply's message type and payload. Raises OSError(errno) on
    a kernel error. Replies to other requests on a reused socket are skipped (by sequence number)."""
    with _socket(sock) as s:
        seq = next(_seq) & 0xFFFFFFFF
        s.send(_HDR.pack(_HDR.size + len(payload), kind, NLM_F_REQUEST | flags, seq, 0) + payload)
        for _ in range(64):
            data = s.recv(1 << 16)
            length, mtype, _f, mseq, _pid = _HDR.unpack_from(data, 0)
            if mseq != seq:
                continue
            if mtype == NLMSG_ERROR:
                err = -struct.unpack_from("=i", data, _HDR.size)[0]
                if err:
                    raise OSError(err, os.strerror(err))
            return mtype, data[_HDR.size : length]
        raise OSError(errno.EPROTO, f"netlink: no reply to request type {kind}")


def get_link(index: int, sock: socket.socket | None = None) -> Msg:
    """The link ``index`` of this netns (RTM_GETLINK for one link, not a dump)."""
    fmt, size = _BODY[RTM_GETLINK]
    mtype, payload = _exchange(sock, RTM_GETLINK, 0, struct.pack(fmt, socket.AF_UNSPEC, 0, index, 0, 0))
    if mtype == NLMSG_ERROR:
        raise OSError(errno.EPROTO, "netlink: an acknowledgement, not a link, in reply to RTM_GETLINK")
    fixed = struct.unpack_from(fmt, payload, 0)
    return Msg(fixed[0], tuple(fixed[1:]), parse_attrs(payload[(size + 3) & ~3 :]))


def link_names() -> dict[int, str]:
    out = {}
    for m in dump(RTM_GETLINK):
        name = m.attrs.get(IFLA_IFNAME, b"").rstrip(b"\0").decode()
        out[m.fields[1]] = name  # fields: type, index, flags, change
    return out


# --- changes -------------------------------------------------------------------------

RTM_NEWADDR, RTM_DELADDR, RTM_NEWROUTE, RTM_DELROUTE, RTM_NEWRULE, RTM_DELRULE = 20, 21, 24, 25, 32, 33
NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x4, 0x200, 0x400
IFA_LOCAL, IFA_FLAGS = 2, 8
RTA_DST = 1
FR_ACT_TO_TBL = 1
RTN_LOCAL = 2
RT_SCOPE_HOST = 254


def _attr(kind: int, value: bytes) -> bytes:
    raw = _ATTR.pack(_ATTR.size + len(value), kind) + value
    return raw + b"\0" * ((4 - len(raw) % 4) % 4)


def _u32(v: int) -> bytes:
    return struct.pack("=I", v)


def request(kind: int, flags: int, body: bytes, attrs: list[tuple[int, bytes]],
            sock: socket.socket | None = None) -> None:
    """Send one change and wait for its ack; raises OSError(errno) on a kernel error."""
    _exchange(sock, kind, NLM_F_ACK | flags, body + b"".join(_attr(k, v) for k, v in attrs))


def link_index(name: str) -> int:
    for idx, n in link_names().items():
        if n == name:
            return idx
    raise OSError(19, f"no interface {name!r}")


def addr(op: str, family: int, index: int, address: str, prefixlen: int, proto: int, flags: int = 0,
         sock: socket.socket | None = None) -> None:
    raw = socket.inet_pton(family, address)
    body = struct.pack("=BBBBI", family, prefixlen, flags & 0xFF, 0, index)
    attrs = [(IFA_LOCAL, raw), (IFA_ADDRESS, raw)]
    if op == "add":
        attrs += [(IFA_FLAGS, _u32(flags)), (IFA_PROTO, bytes([proto]))]
        request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body, attrs, sock)
    else:
        request(RTM_DELADDR, 0, body, attrs, sock)


def local_default_route(op: str, family: int, table: int, oif: int, proto: int) -> None:
    """``ip route add local default dev <oif> table <table> proto <proto>`` (or del)."""
    body = struct.pack("=BBBBBBBBI", family, 0, 0, 0, table if table < 256 else 252, proto, RT_SCOPE_HOST,
                       RTN_LOCAL, 0)
    attrs = [(RTA_TABLE, _u32(table)), (RTA_OIF, _u32(oif))]
    if op == "add":
        request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, body, attrs)
    else:
        request(RTM_DELROUTE, 0, body, attrs)


def fwmark_rule(op: str, family: int, fwmark: int, mask: int, table: int, priority: int, proto: int) -> None:
    """``ip rule add fwmark MARK/MASK lookup TABLE pref PRIORITY proto PROTO`` (or del)."""
    body = struct.pack("=BBBBBBBBI", family, 0, 0, 0, table if table < 256 else 252, 0, 0, FR_ACT_TO_TBL, 0)
    attrs = [(FRA_PRIORITY, _u32(priority)), (FRA_FWMARK, _u32(fwmark)), (FRA_FWMASK, _u32(mask)),
             (FRA_TABLE, _u32(table)), (FRA_PROTOCOL, bytes([proto]))]
    if op == "add":
        request(RTM_NEWRULE, NLM_F_CREATE | NLM_F_EXCL, body, attrs)
    else:
        request(RTM_DELRULE, 0, body, attrs[:4])
