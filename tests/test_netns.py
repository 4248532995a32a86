"""Entering namespaces and the small rtnetlink client, against real namespaces."""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from redirect.kernel import netlink
from redirect.kernel import netns as rnetns
from tests.netkit import Pod, swapping


def _v6_addrs_on_lo(ns: str) -> set[str]:
    out = subprocess.run(["ip", "-n", ns, "-j", "-6", "addr", "show", "dev", "lo"], check=True,
                         capture_output=True, text=True).stdout
    return {a["local"] for link in json.loads(out) for a in link.get("addr_info", [])}


def test_current_fd_and_inode_follow_nested_enters(pod_pair: tuple[Pod, Pod]) -> None:
    a, b = pod_pair
    home = os.stat("/proc/thread-self/ns/net").st_ino
    assert rnetns.current_fd() is None
    assert rnetns.current_inode() == home
    with rnetns.enter(a.name) as fa:
        assert rnetns.current_fd() == fa
        assert rnetns.current_inode() == rnetns.netns_inode(a.name) != home
        with rnetns.enter(b.name) as fb:
            assert rnetns.current_fd() == fb
            assert rnetns.current_inode() == rnetns.netns_inode(b.name)
            assert os.stat("/proc/thread-self/ns/net").st_ino == rnetns.netns_inode(b.name)
        assert rnetns.current_fd() == fa
        assert os.stat("/proc/thread-self/ns/net").st_ino == rnetns.netns_inode(a.name)
    assert rnetns.current_fd() is None
    assert os.stat("/proc/thread-self/ns/net").st_ino == home


_ENTER_OWN = """
import os, sys
from redirect.kernel import netns as n
from redirect.errors import NetnsError
own = os.stat("/proc/thread-self/ns/net").st_ino
with n.enter("/proc/self/ns/net") as fd:
    with n.enter(f"pid:{os.getpid()}"):
        assert n.current_inode() == own and os.fstat(fd).st_ino == own
        print(n.host_netns_reason(), "|", n.host_netns_reason(own_ok=True))
        ran = []
        n.start_thread(lambda: ran.append(os.stat("/proc/thread-self/ns/net").st_ino), "t").join(10)
        assert ran == [own], "a thread started there runs (no setns into its own netns)"
try:
    with n.enter(sys.argv[1]):
        pass
except NetnsError as e:
    print(e)
assert os.stat("/proc/thread-self/ns/net").st_ino == own
"""


def test_entering_the_threads_own_netns_makes_no_setns(pod: Pod) -> None:
    """Without CAP_SYS_ADMIN (an init container's capabilities) a process enters its own netns, in
    any form and nested, and starts the library's threads there, since that takes no setns; the
    host guard judges it all the same (the caller's own; not the host's with ``own_ok``); entering
    another netns fails naming the capability it lacks."""
    p = subprocess.run(["nsenter", f"--net={pod.path}", "--", "setpriv", "--bounding-set=-all,+net_admin,+net_raw",
                        "--inh-caps=-all", "--ambient-caps=-all", "--", sys.executable, "-c", _ENTER_OWN,
                        f"/run/netns/{pod.peer_name}"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    reason, rest = p.stdout.split("|", 1)
    assert "caller's own" in reason and rest.split("\n")[0].strip() == "None", p.stdout
    assert "setns failed: Operation not permitted" in p.stdout and "needs CAP_SYS_ADMIN" in p.stdout, p.stdout


def test_current_fd_is_cleared_when_the_body_raises(pod: Pod) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with rnetns.enter(pod.name):
            raise RuntimeError("boom")
    assert rnetns.current_fd() is None
    assert rnetns.current_inode() == os.stat("/proc/thread-self/ns/net").st_ino


def test_one_rtnetlink_socket_serves_dumps_and_changes_in_turn(pod: Pod) -> None:
    """A shared socket matches replies by sequence number: an error reply (EEXIST) leaves it usable."""
    with rnetns.enter(pod.name), netlink.open_socket() as s:
        before = netlink.dump(netlink.RTM_GETADDR, socket.AF_INET6, sock=s)
        assert any(m.attrs.get(netlink.IFA_ADDRESS) == socket.inet_pton(socket.AF_INET6, "::1") for m in before)
        netlink.addr("add", socket.AF_INET6, 1, "fd00::77", 128, 0xBC, 0x02, sock=s)  # IFA_F_NODAD
        with pytest.raises(OSError) as ei:
            netlink.addr("add", socket.AF_INET6, 1, "fd00::77", 128, 0xBC, 0x02, sock=s)
        assert ei.value.errno == errno.EEXIST
        after = netlink.dump(netlink.RTM_GETADDR, socket.AF_INET6, sock=s)
        assert len(after) == len(before) + 1
        assert "fd00::77" in _v6_addrs_on_lo(pod.name)
        netlink.addr("del", socket.AF_INET6, 1, "fd00::77", 128, 0xBC, sock=s)
        assert len(netlink.dump(netlink.RTM_GETADDR, socket.AF_INET6, sock=s)) == len(before)
    assert "fd00::77" not in _v6_addrs_on_lo(pod.name)


def test_ipv6_enabled_reads_the_disable_ipv6_switch_without_proc_sys(pod: Pod) -> None:
    """``routes.ipv6_enabled`` follows ``net.ipv6.conf.all.disable_ipv6`` (as lo's devconf over
    rtnetlink), also while lo is down and has no ``::1``."""
    from redirect.kernel import routes

    def sysctl(value: int) -> None:
        subprocess.run(["ip", "netns", "exec", pod.name, "sysctl", "-qw", f"net.ipv6.conf.all.disable_ipv6={value}"],
                       check=True)

    with rnetns.enter(pod.name):
        assert routes.ipv6_enabled()
    sysctl(1)
    try:
        with rnetns.enter(pod.name):
            assert not routes.ipv6_enabled()
    finally:
        sysctl(0)
    subprocess.run(["ip", "-n", pod.name, "link", "set", "lo", "down"], check=True)
    try:
        assert "::1" not in _v6_addrs_on_lo(pod.name)
        with rnetns.enter(pod.name):
            assert routes.ipv6_enabled()
    finally:
        subprocess.run(["ip", "-n", pod.name, "link", "set", "lo", "up"], check=True)


HOLDER = """
import sys, time
from redirect import api
with api.netns_lock(int(sys.argv[1])):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
print("released", flush=True)
"""


def _hold_lock(inode: int, seconds: float) -> subprocess.Popen[str]:
    """Another process holding the netns lock of ``inode`` for ``seconds`` (returns once it holds it)."""
    import sys

    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(inode), str(seconds)], stdout=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.stdout is not None
    line = p.stdout.readline()  # bounded: the holder prints at once, or dies and closes stdout
    if line.strip() != "held":
        p.kill()
        p.wait(5)
        raise AssertionError(f"lock holder did not start: {line!r}")
    return p


def _hold_lock_in_thread(inode: int, seconds: float) -> threading.Thread:
    """A thread of this process holding the netns lock of ``inode`` for ``seconds`` (returns once
    it holds it)."""
    from redirect import api

    held = threading.Event()

    def hold() -> None:
        with api.netns_lock(inode):
            held.set()
            time.sleep(seconds)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert held.wait(10), "lock holder thread did not start"
    return t


def test_netns_lock_keeps_out_other_threads_and_forked_children(pod: Pod) -> None:
    """One lock for threads and processes: while a thread holds a netns, another thread of the
    same process, and a child forked meanwhile (which shares the holder's open files), wait for
    it and give up after ``wait_s``; another netns is free."""
    import redirect
    from redirect import api

    inode = rnetns.netns_inode(pod.name)
    holder = _hold_lock_in_thread(inode, 2.0)
    try:
        with pytest.raises(redirect.SetupError, match="another thread or process"):
            with api.netns_lock(inode, wait_s=0.2):
                pass
        with api.netns_lock(inode + 1, wait_s=0.2):
            pass
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the parent's thread keeps it out
            code = 1
            try:
                with api.netns_lock(inode, wait_s=0.2):
                    pass
            except redirect.SetupError:
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "a forked child took the lock its parent's thread holds"
    finally:
        holder.join(10)
    with api.netns_lock(inode, wait_s=0.2):  # released with the holder
        pass


def test_setup_waits_for_another_process_changing_the_same_netns(pod: Pod) -> None:
    import redirect
    from redirect import api

    holder = _hold_lock(rnetns.netns_inode(pod.name), 1.0)
    try:
        t0 = time.monotonic()
        res = redirect.setup(pod.name, None, backend="nftables")
        waited = time.monotonic() - t0
        assert res.changed and waited >= 0.5, waited  # it waited for the holder (1 s from its start)
        assert holder.wait(10) == 0
        # Another pod's netns is not held up by a lock on this one.
        holder = _hold_lock(rnetns.netns_inode(pod.name), 5.0)
        with pytest.raises(redirect.SetupError, match="another thread or process"):
            with api.netns_lock(rnetns.netns_inode(pod.name), wait_s=0.2):
                pass
        with pytest.raises(redirect.SetupError, match=f"^netns='{pod.name}' \\(inode "):  # as the caller named it
            with api.netns_lock(rnetns.netns_inode(pod.name), wait_s=0.2, name=pod.name):
                pass
        with api.netns_lock(rnetns.netns_inode(pod.name) + 1, wait_s=0.2):
            pass
    finally:
        holder.kill()
        holder.wait(10)
        redirect.teardown(pod.name, backend="nftables")


# --- sysctls: rdr_sysctl_open -----------------------------------------------------------

_SYSCTL = "net/ipv4/tcp_fwmark_accept"


def _sysctl_fd(flags: int) -> int:
    from redirect.native import load

    return int(load().lib.rdr_sysctl_open(_SYSCTL.encode(), flags))


def test_a_sysctl_is_opened_in_the_calling_threads_netns_through_any_number_of_lookups() -> None:
    """``rdr_sysctl_open`` opens the sysctl of the netns the thread is in when it asks (each thread
    looks up through a procfs instance of its own, replaced every ``RDR_SYSCTL_LOOKUPS``): written
    through it in more namespaces than that, each value is the one /proc/sys shows there, in this
    thread and in another."""
    from redirect.kernel import podkit
    from redirect.native import load

    n = 2 * load().lib.RDR_SYSCTL_LOOKUPS + 3
    names = [f"rdrt-sy{os.getpid()}-{i}" for i in range(n)]
    podkit.create_netns_many(names)
    try:
        def write_all(offset: int) -> None:
            for i, ns in enumerate(names):
                with rnetns.enter(ns):
                    fd = _sysctl_fd(os.O_RDWR)
                    assert fd >= 0, os.strerror(-fd)
                    try:
                        os.pwrite(fd, b"%d\n" % ((i + offset) % 2), 0)
                    finally:
                        os.close(fd)

        def read_all() -> list[int]:
            out = []
            for ns in names:
                with rnetns.enter(ns), open(f"/proc/sys/{_SYSCTL}") as f:
                    out.append(int(f.read()))
            return out

        write_all(0)
        assert read_all() == [i % 2 for i in range(n)]
        t = threading.Thread(target=write_all, args=(1,))
        t.start()
        t.join(60)
        assert read_all() == [(i + 1) % 2 for i in range(n)]
    finally:
        podkit.remove_netns_many(names)


_SYSCTL_RO = f"""
import errno, os, sys
from redirect.native import load
lib = load().lib
rw, ro = lib.rdr_sysctl_open(b"{_SYSCTL}", os.O_RDWR), lib.rdr_sysctl_open(b"{_SYSCTL}", os.O_RDONLY)
print(errno.errorcode.get(-rw, "opened"), errno.errorcode.get(-ro, "opened"))
"""


@pytest.mark.parametrize("how", ["read-only", "masked", "no-sys-admin"])
def test_a_sysctl_is_opened_no_more_than_proc_sys_allows(pod: Pod, how: str) -> None:
    """Where /proc/sys is read-only (as a runtime mounts it in a container) or /proc/sys/net is masked,
    ``rdr_sysctl_open`` opens what /proc/sys allows and no more, even with CAP_SYS_ADMIN (which would
    let it mount a procfs of its own); without that capability it opens through /proc/sys."""
    prep = {"read-only": "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys",
            "masked": "mount -t tmpfs none /proc/sys/net", "no-sys-admin": "true"}[how]
    run = [sys.executable, "-c", _SYSCTL_RO]
    if how == "no-sys-admin":
        run = ["setpriv", "--bounding-set=-all,+net_admin,+net_raw", "--inh-caps=-all", "--ambient-caps=-all", *run]
    p = subprocess.run(["nsenter", f"--net={pod.path}", "--", "unshare", "--mount", "--propagation", "private", "--",
                        "sh", "-c", f'{prep} && exec "$@"', "sh", *run], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    want = {"read-only": "EROFS opened", "masked": "ENOENT ENOENT", "no-sys-admin": "opened opened"}[how]
    assert p.stdout.split() == want.split(), p.stdout


def test_our_netlink_sockets_take_answers_from_the_kernel_only(pod: Pod) -> None:
    """A process in a pod's netns (its root has CAP_NET_ADMIN there) cannot send datagrams to the
    netlink sockets setup opens there, the native ones and the Python ones alike: they would be read
    as the kernel's answers (a forged address, a forged ack)."""
    from redirect.native import load

    lib = load().lib
    with rnetns.enter(pod.name):
        forger = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, netlink.NETLINK_ROUTE)
        fd = lib.rdr_nl_socket(netlink.NETLINK_ROUTE)
        assert fd >= 0, os.strerror(-fd)
        ours = socket.socket(fileno=fd)
        py = netlink.NetlinkSocket()
        try:
            forger.bind((0, 0))
            for s in (ours, py.sock):
                port = s.getsockname()[0]
                assert port != 0
                forged = bytes(16)  # (a header: what it says does not matter)
                with pytest.raises(ConnectionRefusedError):
                    forger.sendto(forged, (port, 0))
            # and the kernel still answers them
            assert netlink.addresses(sock=py)
        finally:
            forger.close()
            ours.close()
            py.close()


def test_a_path_swapped_while_it_is_opened_gives_one_of_the_namespaces_it_named(
        pod_pair: tuple[Pod, Pod], tmp_path: os.PathLike[str]) -> None:
    """A symlink swapped between two netns (atomically, by a rename over it) as fast as a thread can
    while it is opened again and again (at most 3000 opens, at most 20 s): every open gives one of
    the two netns, whole; a swap between looking at the path and opening it never makes a good
    path look bad."""
    a, b = pod_pair
    inodes = {os.stat(p.path).st_ino for p in (a, b)}
    link = os.path.join(tmp_path, "ns")
    seen: set[int] = set()
    deadline = time.monotonic() + 20
    with swapping(link, (a.path, b.path)):
        for _ in range(3000):
            if time.monotonic() > deadline:
                break
            fd = rnetns.open_netns(link)
            try:
                seen.add(os.fstat(fd).st_ino)
            finally:
                os.close(fd)
    assert seen <= inodes and seen


#: An address that goes ahead of every global one on its device (scope host: the kernel inserts a
#: primary IPv4 address after the last one of a scope as wide or wider), so adding it moves every
#: later address's place in an address dump by one.
AHEAD = "10.255.0.1"


class _AddsAheadAfterFirstRecv:
    """A netlink socket that adds ``AHEAD`` in ``ns`` once, right after its first ``recv``: between
    two parts of the dump being read (the kernel makes each part when the one before is read)."""

    def __init__(self, sock: socket.socket, ns: str) -> None:
        self.sock, self.ns, self.recvs = sock, ns, 0

    def recv(self, size: int) -> bytes:
        data = self.sock.recv(size)
        self.recvs += 1
        if self.recvs == 1:
            subprocess.run(["ip", "-n", self.ns, "addr", "add", f"{AHEAD}/32", "dev", "d0", "scope", "host"],
                           check=True, timeout=10)
        return data

    def __getattr__(self, name: str) -> object:
        return getattr(self.sock, name)


def test_an_address_dump_the_kernel_flags_inconsistent_is_made_again(pod: Pod,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel resumes an address dump by position: an address added ahead of the others between
    two parts of it makes one of them come twice, and it flags the later parts (NLM_F_DUMP_INTR).
    The rtnetlink client makes such a dump again, and answers with the whole one."""
    stable = [f"10.201.{i // 250}.{i % 250 + 1}" for i in range(1500)]  # (several parts of a dump)
    lines = ["link add d0 type veth peer name d1", "link set d0 up"] + [f"addr add {a}/32 dev d0" for a in stable]
    subprocess.run(["ip", "-n", pod.name, "-batch", "-"], input="\n".join(lines).encode(), check=True, timeout=60)
    dumps: list[bool] = []
    once = netlink.NetlinkSocket._dump_once

    def counted(self: netlink.NetlinkSocket, kind: int, body: bytes) -> tuple[list[tuple[int, bytes]], bool]:
        out, intr = once(self, kind, body)
        dumps.append(intr)
        return out, intr

    monkeypatch.setattr(netlink.NetlinkSocket, "_dump_once", counted)
    with rnetns.enter(pod.name), netlink.open_socket() as s:
        s.sock = _AddsAheadAfterFirstRecv(s.sock, pod.name)  # type: ignore[assignment]
        got = [socket.inet_ntop(socket.AF_INET, m.attrs[netlink.IFA_LOCAL])
               for m in netlink.dump(netlink.RTM_GETADDR, socket.AF_INET, sock=s) if netlink.IFA_LOCAL in m.attrs]
    assert dumps == [True, False], "the kernel flagged the first dump; the second is the answer"
    twice = {a for a in stable + [AHEAD] if got.count(a) != 1}
    assert not twice, f"not once each: {sorted(twice)[:5]}"


def _netconf(seq: int, ifindex: int, flags: int) -> bytes:
    """An RTM_NEWNETCONF message of a dump (IPv4, ``ifindex``, forwarding on) with ``flags``."""
    attrs = struct.pack("=HHi", 8, 1, ifindex) + struct.pack("=HHi", 8, 2, 1)  # NETCONFA_IFINDEX, _FORWARDING
    body = struct.pack("=B3x", socket.AF_INET) + attrs
    return struct.pack("=IHHII", 16 + len(body), 80, 0x2 | flags, seq, 0) + body  # NLM_F_MULTI


def _done(seq: int, flags: int) -> bytes:
    return struct.pack("=IHHIIi", 20, netlink.NLMSG_DONE, 0x2 | flags, seq, 0, 0)


@pytest.mark.parametrize("flagged", [1, netlink.DUMP_TRIES])
def test_the_native_dump_reads_again_what_the_kernel_flags(flagged: int) -> None:
    """The native dumps (the pod's addresses and forwarding settings of every eBPF setup) take the
    same flag (NLM_F_DUMP_INTR) alike: what a flagged dump gave is forgotten and the dump made again,
    at most RDR_NL_DUMP_TRIES times in all (then -EINTR). The peer here answers as the kernel does
    to an interrupted netconf dump, ``flagged`` times, then whole (a native dump gives no place to
    change the namespace between its parts: the test above shows the kernel's flag on a real one)."""
    from redirect.native import load

    native = load()
    tries = netlink.DUMP_TRIES  # (native/netlink.h's RDR_NL_DUMP_TRIES, mirrored)
    ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def kernel() -> None:
        for i in range(min(flagged + 1, tries)):
            req = peer.recv(4096)
            seq = struct.unpack_from("=I", req, 8)[0]
            intr = netlink.NLM_F_DUMP_INTR if i < flagged else 0
            peer.send(_netconf(seq, 5 + i, intr))
            peer.send(_done(seq, intr))

    t = threading.Thread(target=kernel, daemon=True)
    t.start()
    try:
        out = native.ffi.new("int[]", 8)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("=qq", 5, 0))  # (blocking, bounded)
        n = native.lib.rdr_forwarding_on(ours.fileno(), out, 8)
    finally:
        t.join(timeout=5)
        ours.close()
        peer.close()
    if flagged < tries:
        assert [out[i] for i in range(n)] == [5 + flagged], "only the whole dump's interfaces"
    else:
        assert n == -errno.EINTR
