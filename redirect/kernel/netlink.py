"""The library's one netlink client in Python, over raw netlink sockets: rtnetlink (dump links,
rules, routes and addresses; add or delete the few of them an intent needs, local addresses, a
local default route, fwmark rules; make and bring up the test kit's veths), sock_diag (the TCP
listeners of a port) and nfnetlink's ipset (whether a set exists, its removal).

It needs only the standard library: importing a netlink library takes long enough to dominate a
short-lived process that sets up one pod (every setup, check and teardown, the CNI plugin and
``redirect init`` speak netlink through here). ``NetlinkSocket`` is one socket with its own sequence
numbers; it stays in the netns of the thread that made it (a socket keeps the netns it was made in),
and the functions below open one there for each call unless given one. (The native helpers speak
netlink through their own one client, ``native/netlink.c``.)
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

NETLINK_ROUTE, NETLINK_SOCK_DIAG, NETLINK_NETFILTER = 0, 4, 12
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x4, 0x200, 0x400
NLM_F_DUMP_INTR = 0x10  # (on a dump's messages: what it lists changed while it was dumped)
#: Dumps made at most, while the kernel flags each inconsistent (as native/netlink.h's RDR_NL_DUMP_TRIES).
DUMP_TRIES = 8
NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_NEWLINK, RTM_GETLINK = 16, 18
RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22
RTM_NEWROUTE, RTM_GETROUTE = 24, 26
RTM_GETRULE = 34

# attribute numbers (linux/fib_rules.h, rtnetlink.h, if_addr.h, if_link.h, veth.h)
FRA_PRIORITY, FRA_FWMARK, FRA_TABLE, FRA_FWMASK, FRA_PROTOCOL = 6, 10, 15, 16, 21
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_TABLE = 1, 4, 5, 15
IFA_ADDRESS, IFA_LOCAL, IFA_FLAGS, IFA_PROTO = 1, 2, 8, 11
IFLA_IFNAME, IFLA_OPERSTATE, IFLA_LINKINFO, IFLA_NET_NS_FD, IFLA_AF_SPEC = 3, 16, 18, 28, 26
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
IFLA_INET6_CONF = 2
DEVCONF_DISABLE_IPV6 = 26  # index in IFLA_INET6_CONF's array of s32 (linux/ipv6.h)
IF_OPER_UP, IFF_UP = 6, 0x1
RTN_UNICAST, RT_SCOPE_UNIVERSE = 1, 0
RT_TABLE_MAIN, RTPROT_BOOT = 254, 3

_HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_ATTR = struct.Struct("=HH")
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family type index flags change


@dataclass
class Msg:
    """One dumped rtnetlink object: its fixed header fields and its attributes (raw bytes)."""

    family: int
    fields: tuple[int, ...]
    attrs: dict[int, bytes] = field(default_factory=dict)

    def u32(self, attr: int) -> int | None:
        v = self.attrs.get(attr)
        return None if v is None else int(struct.unpack("=I", v[:4])[0])

    def u8(self, attr: int) -> int | None:
        v = self.attrs.get(attr)
        return None if v is None else v[0]


# request body and the struct of the reply's fixed part, per rtnetlink message type
_BODY = {
    RTM_GETRULE: ("=BBBBBBBBI", 12),  # fib_rule_hdr: family dst_len src_len tos table res1 res2 action flags
    RTM_GETROUTE: ("=BBBBBBBBI", 12),  # rtmsg: family dst_len src_len tos table protocol scope type flags
    RTM_GETADDR: ("=BBBBI", 8),  # ifaddrmsg: family prefixlen flags scope index
    RTM_GETLINK: ("=BxHiII", 16),  # ifinfomsg: family type index flags change
}


class NetlinkSocket:
    """One netlink socket of ``protocol`` in the calling thread's netns, for several exchanges in
    turn (each answer is told from a stale one by its sequence number); closed by ``close`` or at the
    end of a ``with``."""

    def __init__(self, protocol: int = NETLINK_ROUTE, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, protocol)
        try:
            self.sock.settimeout(timeout)
            self.sock.bind((0, 0))
            # Connected to the kernel: it refuses any other sender's datagram to this socket, so a
            # process in the netns (a pod's root) cannot pass one off as an answer.
            self.sock.connect((0, 0))
        except BaseException:
            self.sock.close()
            raise
        self._seq = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> NetlinkSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, kind: int, flags: int, payload: bytes) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        self.sock.send(_HDR.pack(_HDR.size + len(payload), kind, NLM_F_REQUEST | flags, self._seq, 0) + payload)
        return self._seq

    def dump(self, kind: int, body: bytes) -> list[tuple[int, bytes]]:
        """Every message answering the dump request ``kind`` with ``body``: (type, payload). A dump
        the kernel flags inconsistent (``NLM_F_DUMP_INTR``: what it lists changed meanwhile, so an
        object may be missing or there twice) is made again, at most ``DUMP_TRIES`` times in all,
        then ``OSError(EINTR)``."""
        for _ in range(DUMP_TRIES):
            out, intr = self._dump_once(kind, body)
            if not intr:
                return out
        raise OSError(errno.EINTR, f"netlink: what request type {kind} dumps kept changing while it was read"
                                   f" ({DUMP_TRIES} dumps in a row flagged inconsistent)")

    def _dump_once(self, kind: int, body: bytes) -> tuple[list[tuple[int, bytes]], bool]:
        seq = self._send(kind, NLM_F_DUMP, body)
        out: list[tuple[int, bytes]] = []
        intr = False
        while True:
            data = self.sock.recv(1 << 16)
            off = 0
            while off + _HDR.size <= len(data):
                length, mtype, flags, mseq, _pid = _HDR.unpack_from(data, off)
                if length < _HDR.size:
                    return out, intr
                if mseq == seq:
                    intr = intr or bool(flags & NLM_F_DUMP_INTR)
                    if mtype == NLMSG_DONE:
                        return out, intr
                    if mtype == NLMSG_ERROR:
                        _raise(data, off)
                        return out, intr
                    out.append((mtype, data[off + _HDR.size : off + length]))
                off += (length + 3) & ~3

    def exchange(self, kind: int, flags: int, payload: bytes) -> tuple[int, bytes]:
        """Send one (non-dump) request; its answer's message type and payload. ``OSError(errno)``
        on a kernel error; answers to other requests on the socket are skipped."""
        seq = self._send(kind, flags, payload)
        for _ in range(64):
            data = self.sock.recv(1 << 16)
            length, mtype, _f, mseq, _pid = _HDR.unpack_from(data, 0)
            if mseq != seq:
                continue
            if mtype == NLMSG_ERROR:
                _raise(data, 0)
            return mtype, data[_HDR.size : length]
        raise OSError(errno.EPROTO, f"netlink: no reply to request type {kind}")

    def request(self, kind: int, flags: int, body: bytes, attrs: Sequence[bytes] = ()) -> None:
        """Send one change (``body`` then the attributes, each ``attr(...)``) and wait for its ack."""
        self.exchange(kind, NLM_F_ACK | flags, body + b"".join(attrs))


def _raise(data: bytes, off: int) -> None:
    err = -struct.unpack_from("=i", data, off + _HDR.size)[0]
    if err:
        raise OSError(err, os.strerror(err))


def open_socket(protocol: int = NETLINK_ROUTE) -> NetlinkSocket:
    """A ``NetlinkSocket`` in the calling thread's netns, for several calls below (``sock=``)."""
    return NetlinkSocket(protocol)


@contextlib.contextmanager
def _using(sock: NetlinkSocket | None, protocol: int = NETLINK_ROUTE) -> Iterator[NetlinkSocket]:
    if sock is not None:
        yield sock
        return
    with NetlinkSocket(protocol) as s:
        yield s


def attr(kind: int, value: bytes) -> bytes:
    """A netlink attribute, padded."""
    raw = _ATTR.pack(_ATTR.size + len(value), kind) + value
    return raw + b"\0" * ((4 - len(raw) % 4) % 4)


def nest(kind: int, *attrs: bytes) -> bytes:
    """A nested attribute holding ``attrs`` (without ``NLA_F_NESTED``, as iproute2 sends them)."""
    return attr(kind, b"".join(attrs))


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


def _u32(v: int) -> bytes:
    return struct.pack("=I", v)


# --- rtnetlink ---------------------------------------------------------------------------


def _msg(payload: bytes, kind: int) -> Msg:
    fmt, size = _BODY[kind]
    fixed = struct.unpack_from(fmt, payload, 0)
    return Msg(fixed[0], tuple(fixed[1:]), parse_attrs(payload[(size + 3) & ~3 :]))


def dump(kind: int, family: int = socket.AF_UNSPEC, sock: NetlinkSocket | None = None) -> list[Msg]:
    """Every object of ``kind`` (RTM_GET*) of ``family``; on ``sock`` if given (else a socket of its own)."""
    fmt, size = _BODY[kind]
    body = struct.pack(fmt, family, *([0] * (len(struct.unpack(fmt, bytes(size))) - 1)))
    with _using(sock) as s:
        return [_msg(p, kind) for _t, p in s.dump(kind, body)]


def get_link(index: int, sock: NetlinkSocket | None = None) -> Msg:
    """The link ``index`` of this netns (RTM_GETLINK for one link, not a dump)."""
    with _using(sock) as s:
        mtype, payload = s.exchange(RTM_GETLINK, 0, _IFINFO.pack(socket.AF_UNSPEC, 0, index, 0, 0))
    if mtype == NLMSG_ERROR:
        raise OSError(errno.EPROTO, "netlink: an acknowledgement, not a link, in reply to RTM_GETLINK")
    return _msg(payload, RTM_GETLINK)


def link_names(sock: NetlinkSocket | None = None) -> dict[int, str]:
    """ifindex -> name of this netns's links."""
    return {m.fields[1]: m.attrs.get(IFLA_IFNAME, b"").rstrip(b"\0").decode()  # fields: type, index, flags, change
            for m in dump(RTM_GETLINK, sock=sock)}


def link_index(name: str, sock: NetlinkSocket | None = None) -> int:
    for idx, n in link_names(sock).items():
        if n == name:
            return idx
    raise OSError(errno.ENODEV, f"no interface {name!r}")


def link_up(index: int, sock: NetlinkSocket | None = None) -> bool:
    """Whether the link ``index`` is operationally up (its carrier is there)."""
    return get_link(index, sock).u8(IFLA_OPERSTATE) == IF_OPER_UP


def set_up(index: int, sock: NetlinkSocket | None = None) -> None:
    """``ip link set <index> up``."""
    with _using(sock) as s:
        s.request(RTM_NEWLINK, 0, _IFINFO.pack(socket.AF_UNSPEC, 0, index, IFF_UP, IFF_UP))


def add_veth(name: str, peer: str, peer_netns_fd: int | None = None, sock: NetlinkSocket | None = None) -> None:
    """``ip link add <name> type veth peer name <peer> [netns <fd>]``: a veth pair, its peer end in
    the netns of ``peer_netns_fd`` (an open netns fd) if given."""
    peer_attrs = [attr(IFLA_IFNAME, peer.encode() + b"\0")]
    if peer_netns_fd is not None:
        peer_attrs.append(attr(IFLA_NET_NS_FD, _u32(peer_netns_fd)))
    info = nest(IFLA_LINKINFO, attr(IFLA_INFO_KIND, b"veth\0"),
                nest(IFLA_INFO_DATA, nest(VETH_INFO_PEER, _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0), *peer_attrs)))
    with _using(sock) as s:
        s.request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0),
                  [attr(IFLA_IFNAME, name.encode() + b"\0"), info])


def addresses(family: int = socket.AF_UNSPEC, sock: NetlinkSocket | None = None) -> list[tuple[int, int, str]]:
    """(family, ifindex, address) of this netns's addresses."""
    out = []
    for m in dump(RTM_GETADDR, family, sock):
        raw = m.attrs.get(IFA_ADDRESS)
        if raw is not None and m.family in (socket.AF_INET, socket.AF_INET6):
            out.append((m.family, m.fields[3], socket.inet_ntop(m.family, raw)))
    return out


def addr(op: str, family: int, index: int, address: str, prefixlen: int, proto: int, flags: int = 0,
         sock: NetlinkSocket | None = None) -> None:
    """``ip addr add|del <address>/<prefixlen> dev <index> proto <proto>`` (with ``flags``)."""
    raw = socket.inet_pton(family, address)
    body = struct.pack("=BBBBI", family, prefixlen, flags & 0xFF, 0, index)
    attrs = [attr(IFA_LOCAL, raw), attr(IFA_ADDRESS, raw)]
    with _using(sock) as s:
        if op == "add":
            s.request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body,
                      [*attrs, attr(IFA_FLAGS, _u32(flags)), attr(IFA_PROTO, bytes([proto]))])
        else:
            s.request(RTM_DELADDR, 0, body, attrs)


def default_route(family: int, gateway: str, sock: NetlinkSocket | None = None) -> None:
    """``ip route add default via <gateway>`` (main table)."""
    body = struct.pack("=BBBBBBBBI", family, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_UNIVERSE, RTN_UNICAST, 0)
    with _using(sock) as s:
        s.request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, body, [attr(RTA_GATEWAY, socket.inet_pton(family, gateway))])


# --- sock_diag -----------------------------------------------------------------------------

SOCK_DIAG_BY_FAMILY, TCP_LISTEN_STATES = 20, 1 << 10
_INET_DIAG_REQ = struct.Struct("=BBBBI48x")  # inet_diag_req_v2: family protocol ext pad states, sockid


def tcp_listeners(port: int) -> dict[int, int]:
    """Socket inode -> family of the TCP listeners on ``port`` in this netns.

    A listener dump walks only the listening hash (reading /proc/net/tcp walks every socket of the
    host: docs/kernel-facts.md, ``SOCK_DIAG_BY_FAMILY``)."""
    out: dict[int, int] = {}
    with NetlinkSocket(NETLINK_SOCK_DIAG, timeout=2.0) as s:
        for fam in (socket.AF_INET, socket.AF_INET6):
            for _t, p in s.dump(SOCK_DIAG_BY_FAMILY, _INET_DIAG_REQ.pack(fam, socket.IPPROTO_TCP, 0, 0,
                                                                         TCP_LISTEN_STATES)):
                # inet_diag_msg: family state timer retrans, then the sockid (sport first), ..., inode at 68
                if len(p) >= 72 and struct.unpack_from("!H", p, 4)[0] == port:
                    out[struct.unpack_from("=I", p, 68)[0]] = 4 if fam == socket.AF_INET else 6
    return out


# --- nfnetlink: ipset ------------------------------------------------------------------------

NFNL_SUBSYS_IPSET, IPSET_CMD_DESTROY, IPSET_CMD_HEADER = 6, 3, 12
IPSET_ATTR_PROTOCOL, IPSET_ATTR_SETNAME, IPSET_PROTOCOL = 1, 2, 7
_NFGEN = struct.Struct("=BBH")  # nfgenmsg: family, version, res_id (big endian: 0 here)


def _ipset(cmd: int, name: str, sock: NetlinkSocket | None) -> bool:
    """The ipset command ``cmd`` on the set ``name`` (on ``sock``, a ``NETLINK_NETFILTER`` socket, or
    one of its own in this netns): True if done, False if there is no such set."""
    body = _NFGEN.pack(socket.AF_INET, 0, 0)
    attrs = [attr(IPSET_ATTR_PROTOCOL, bytes([IPSET_PROTOCOL])), attr(IPSET_ATTR_SETNAME, name.encode() + b"\0")]
    try:
        with _using(sock, NETLINK_NETFILTER) as s:
            s.request((NFNL_SUBSYS_IPSET << 8) | cmd, 0, body, attrs)
    except OSError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    return True


def ipset_exists(name: str, sock: NetlinkSocket | None = None) -> bool:
    """Whether the netns has an ipset of that name (its header is asked for; nothing of its
    content is read)."""
    return _ipset(IPSET_CMD_HEADER, name, sock)


def ipset_destroy(name: str, sock: NetlinkSocket | None = None) -> None:
    """Remove the ipset ``name`` from the netns (the kernel acknowledges the removal of a set that is
    not there as well: ``ipset_exists`` tells)."""
    _ipset(IPSET_CMD_DESTROY, name, sock)


__all__ = ["NetlinkSocket", "Msg", "open_socket", "attr", "nest", "parse_attrs", "dump", "get_link", "link_names",
           "link_index", "link_up", "set_up", "add_veth", "addresses", "addr", "default_route",
           "tcp_listeners", "ipset_exists", "ipset_destroy"]
