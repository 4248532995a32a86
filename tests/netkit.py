"""The kit every integration test uses: real namespaces, veths, listeners and probes.

Nothing here is mocked. A ``Pod`` is two fresh network namespaces (the pod and a
``-peer`` standing for "the rest of the network") joined by a veth pair with IPv4
and IPv6 addresses. Listeners run in background threads inside a namespace and
record what they saw (peer, local address, ``SO_ORIGINAL_DST``, first line); each
answers with its label, so a probe learns which listener it reached::

    with make_pod() as pod, TcpListener(pod.peer_name, 8080, label="app") as app:
        hit = landing(pod.name, pod.peer_ip4, 8080, app)
        assert hit.label == "app"
        assert hit.conn.local == (pod.peer_ip4, 8080)

In parts: ``tests.kit.pods`` (namespaces, pods; the factory itself is
``redirect.kernel.podkit``, shared with the demo), ``tests.kit.listeners`` and
``tests.kit.probes`` (probes and ``landing``); this module gathers them under one name.

Every socket operation has a timeout (2 s by default) and every namespace the kit
creates is removed on the way out, even when the body raises. Traffic only goes to
loopback or to addresses inside the namespaces the kit made.
"""

from tests.kit.listeners import (
    IP_PKTINFO,
    IP_RECVORIGDSTADDR,
    IP_TRANSPARENT,
    IPV6_PKTINFO,
    IPV6_RECVORIGDSTADDR,
    IPV6_RECVPKTINFO,
    IPV6_TRANSPARENT,
    SO_MARK,
    SOL_IP,
    SOL_IPV6,
    Conn,
    Listener,
    TcpListener,
    UdpListener,
    original_dst,
)
from tests.kit.pods import (
    DEFAULT_TIMEOUT,
    NETNS_DIR,
    OUR_TC,
    PREFIX,
    VM_NET,
    Addr,
    Link,
    Pod,
    create_netns,
    existing_namespaces,
    in_netns,
    link_for,
    link_local,
    live_namespaces,
    make_pod,
    netlink_in,
    qdisc_kinds,
    remove_netns,
    repoint,
    require_root,
    set_forwarding,
    swapping,
    tc_filters,
    vm_behind,
    wait_link_detached,
)
from tests.kit.probes import (
    Landing,
    ProbeResult,
    connect_as,
    in_child,
    landing,
    tcp_probe,
    tcp_probe_detail,
    udp_probe,
    udp_probe_detail,
)

__all__ = [
    "IP_PKTINFO", "IP_RECVORIGDSTADDR", "IP_TRANSPARENT", "IPV6_PKTINFO", "IPV6_RECVORIGDSTADDR", "IPV6_RECVPKTINFO",
    "IPV6_TRANSPARENT", "SO_MARK", "SOL_IP", "SOL_IPV6", "Conn", "Listener", "TcpListener", "UdpListener",
    "original_dst", "DEFAULT_TIMEOUT", "NETNS_DIR", "OUR_TC", "qdisc_kinds", "set_forwarding", "tc_filters",
    "PREFIX", "Addr", "Link", "Pod", "netlink_in", "create_netns",
    "existing_namespaces", "in_netns", "link_for", "link_local", "live_namespaces", "make_pod", "remove_netns",
    "repoint", "swapping", "require_root",
    "wait_link_detached", "Landing", "ProbeResult", "connect_as", "in_child", "landing", "tcp_probe",
    "tcp_probe_detail",
    "udp_probe", "udp_probe_detail", "vm_behind", "VM_NET",
]
