"""The eBPF backend: capture without netfilter.

The package is in two parts. The host side (``.host``: the programs, their pins, the pool, a
process's handles, the loader) is done once per host and kept by a process; the per-pod side
(``.pod``: the entries an intent writes, the pod's network, its tc filters, apply) sets one pod up
through ``host.PodStore``, the one view of the host side it is given. The host side never imports
the per-pod side; this module and ``.unload`` are where the two meet. ``.abi`` (the maps' layouts)
is shared.

Host part, done once per host (``host.HostPrograms.open_or_load``): ``redirect/bpf/*.c`` is
compiled through bcc, against the UAPI headers the package carries (``redirect/bpf/headers/``;
no kernel headers needed), by a short-lived loader process (``host.loader``: no long-lived process
maps bcc or LLVM), every program and map is pinned under a bpffs directory
(``/sys/fs/bpf/redirect``, or ``$REDIRECT_BPF_ROOT``), and the cgroup programs
(``connect4/6``, ``sendmsg4/6``, ``recvmsg4/6``, ``getpeername4/6``,
``getsockopt``, ``sock_ops``, ``sock_release``)
are attached to the cgroup v2 root (``/sys/fs/cgroup/unified``, or
``$REDIRECT_BPF_CGROUP``) with pinned ``bpf_link``\\ s. A later process finds
the pins and reuses them: nothing is compiled again. The host programs act
only on sockets whose netns cookie is a key of the ``pods`` map; for every
other socket on the host they are a no-op.

Per pod (``pod.EbpfBackend.apply``, with the calling thread inside the pod netns, as
``redirect.api`` does it: it computes the difference between the entries the lowering wants and
the pod's inventory, and one native call, ``rdr_ebpf_pod_write`` in ``native/pod_setup.c``, writes
it with undo on failure; for a pod with nothing of ours yet, ``setup_fresh`` does it all in one
native call that writes through the same routine, and backs off to ``apply`` before changing
anything when the pod is not fresh): map entries keyed by the netns cookie (policy,
ports, CIDRs, the pod's own addresses as ``local`` CIDRs, the proxy's inbound listeners), an
``inventory`` of exactly those keys, one ``sk_lookup`` link on the pod netns
pinned at ``<root>/pods/<cookie>-sk_lookup`` (every pod has one: the kernel
detaches it when the netns dies, which is how ``collect_garbage`` finds pods
whose netns went without a teardown), and ``::6`` on lo (the intent's address for the proxy's
inbound passthrough). The link runs a program of the pod's own, from a pool loaded ahead
(``host.pool``; ``native/redirect_native.c: rdr_ebpf_pool_prog``): it holds a slot number, and the
slot, claimed at the pod's setup, holds the netns cookie, which an sk_lookup program can't ask
the kernel for; it tail-calls the shared ``rdr_sk_lookup``: nothing
is found by address, so pods sharing an IP never see each other's policy. ``remove`` deletes
exactly those, through the inventory: O(entries of that pod), never a walk of the host maps.
Per-socket state (original destinations) is removed with its socket (``sock_release``, TCP
close) and is inert once the pod's policy is gone. ``unload_host`` removes the host part and refuses while any pod is
registered. A partly pinned host (a pin removed by hand) is reported by ``check``
(``host_problems``: missing pins, cgroup links detached or running another program),
read and torn down through what is still attached (``HostPrograms.recover``), and repaired (missing
cgroup links) or reloaded (no pod registered) by the next setup, else setup raises
``SetupError`` saying what is missing. Fault points for the atomicity
tests: ``ebpf.before_entries``, ``ebpf.after_claim``, ``ebpf.before_policy``.

The backend is given the intent (``redirect.plan.intent``), the one the netfilter plan is lowered
from, never the config: ``redirect.plan.lower_ebpf`` lowers it to typed map entries, which
``pod.entries.packed`` packs; the programs implement Istio's rule order over map lookups
(``redirect/bpf/policy.h: outbound_target``). ``redirect.plan.evaluate`` models them, and a
property test (``tests/test_lowerings.py``) checks that they land every drawn
connection where the netfilter plan does.

Ambient mode lowers the ambient intent (``redirect.plan.lower_ebpf.lower_ambient``), decided by
``redirect/bpf/policy.h: ambient_target`` and ``ambient_listener``; besides its map entries and link an
ambient pod has the intent's policy route by the connection mark and ``tcp_fwmark_accept`` on
(``pod.backend``), through which the node proxy's transparent connections to the app get their replies
(``redirect/bpf/sockopt.c: transparent_connect``); a sidecar with TPROXY has the same for its proxy's
(the intent's route by ``tproxy_mark``).

With ``sockmap`` (this backend's alone), the pod's app <-> proxy connections are paired in the
``pairs`` sockhash at establishment and each send goes to the peer's receive queue
(``redirect/bpf/sockmap.c``; the host loads the ``sk_msg`` program with the others and attaches it
to that map); paired connections stay paired through teardown and unload until they close.

Not available with this backend (``apply`` raises ``BackendUnavailable`` naming
the option, as ``redirect.plan.intent.refusals`` decides): ``drop_invalid`` (conntrack tracks
nothing in a netns without netfilter rules, so there is no INVALID verdict for a program to read;
docs/backends.md).

The maps' keys and values are laid out once, in ``redirect/bpf/abi.h``: the programs and ``native/``
include it, and the struct formats here are derived from cffi's declarations of it
(``.abi``). Program and attach types are taken by the kernel's names.

The modules of each part are listed in their package's docstring (``.host``, ``.pod``); the
layout and how an option travels through it are in docs/development.md.

How the iptables semantics are met without packets:

- "leaves over lo" (Istio's ``-o lo`` rules) is "the destination is loopback
  or one of the pod's own addresses" (those present at setup, IPv6 link-local ones included,
  plus ``::6``;
  ``check`` reports addresses added later). So, as with iptables, the app's
  connection to its own pod IP is not captured, and the proxy's (uid/gid 1337)
  goes to inbound capture (the service-VIP hairpin), except to the tunnel port;
- the app's ``getpeername`` names the original destination (TCP and connected
  UDP), as through NAT; a captured socket without an address gets the source
  iptables would show (``bpf_bind`` at connect, the datagram's source at sendmsg:
  the pod's first address of the family, ``pod_policy.src4/src6``; a local
  destination itself), so the proxy sees the pod's address as the peer (docs/backends.md);
- ``exclude_interfaces``: sk_lookup leaves alone what arrives on one; the
  connect hooks leave alone a socket bound to one, and destinations the pod's
  main routing table sends through one (read at setup, ``check`` reports
  route changes, the next setup follows them);
- ``reroute_interfaces``: sk_lookup hands what arrives on one to the proxy's outbound listener
  (registered like the inbound one, ``listener_key.kind``);
- what the pod forwards (a VM behind a reroute interface, a neighbour routing through it) never
  meets sk_lookup: tc programs on the interfaces it forwards on take it by the same decision and
  rewrite it to the proxy's port and back, as netfilter's inbound capture (which matches any
  destination) takes it (``redirect/bpf/tc_forward.c``, ``pod.tc``; docs/backends.md);
- ``inbound_interception="TPROXY"``: inbound is delivered by socket either way;
  the proxy's lo traffic that TPROXY's mangle rules capture goes to the inbound
  port at connect (``redirect/bpf/policy.h: outbound_target``); a proxy connecting to the
  app from the client's address (transparent, ``tproxy_mark``) is left alone by
  sk_lookup and gets the replies by the intent's policy route, as in ambient mode
  (docs/backends.md);
- owner matches use the calling task's uid and primary gid, like iptables'
  ``--uid-owner``/``--gid-owner`` without ``--suppl-groups``; any number of ids
  and ranges: a kind's first range is in the policy entry, the others are
  prefix blocks in the ``cidrs`` trie (a pod with one uid and one gid has none);
  the programs read the host's ids, so in a netns a user namespace of its own owns
  (``hostUsers: false``) the config's are written through its ``uid_map``/``gid_map``
  (``pod.userns``; as netfilter's owner match translates them);
- inbound: the proxy's inbound listener is put in a sockhash when it starts
  listening (``sock_ops`` ``TCP_LISTEN_CB``, also after a proxy restart), or by
  ``apply`` if it already listens. Until one exists, new inbound connections
  to captured ports are dropped (fail closed; iptables answers them with a
  reset from the unused port).
  The proxy's inbound socket sees the original destination as its local
  address; ``getsockopt(SO_ORIGINAL_DST)`` on it answers the same;
- ``getsockopt(SO_ORIGINAL_DST)`` answers at the level conntrack would: ``SOL_IP`` for IPv4
  connections, also as a dual-stack socket's ``::ffff:a.b.c.d`` peer, ``SOL_IPV6`` for native IPv6
  ones, ENOENT at the other level; an app's IPv6 socket connecting to ``::ffff:a.b.c.d`` follows
  the IPv4 rules (it is IPv4 on the wire).
"""

from __future__ import annotations

from ...errors import BackendUnavailable
from ...kernel.netns import current_cookie as current_netns_cookie
from ...plan.intent import AnyIntent
from .host import (
    PROCESS,
    HostPrograms,
    collect_garbage,
    count_pods,
    host,
    probe_kernel,
    registered_pods,
    resolve_cgroup,
    resolve_root,
)
from .pod import EbpfBackend, last_steps, refuse, setup_fresh
from .unload import force_unload_host, unload_host


def refusal(it: AnyIntent | None) -> str | None:
    """Why ``backend="auto"`` would not choose eBPF for intent ``it`` here (None: it would): what
    this host lacks, else the first option of ``it`` the backend cannot lower (``refuse``)."""
    why = PROCESS.host_refusal(resolve_root(None), resolve_cgroup(None))
    if why is not None or it is None:
        return why
    try:
        refuse(it)
    except BackendUnavailable as e:
        return str(e)
    return None


def missing_pins(root: str | None = None) -> list[str]:
    """The host pins missing under ``root`` (``maps/x``, ``progs/x``, ``links/x``; ``maps/build-<id>``
    when the pins come from other sources)."""
    return PROCESS.missing_pins(resolve_root(root))


def build_id() -> str:
    """The digest of ``redirect/bpf/`` the pins record (``maps/build-<id>``)."""
    return PROCESS.build_id()


__all__ = ["EbpfBackend", "setup_fresh", "last_steps", "refusal", "HostPrograms", "host", "unload_host",
           "force_unload_host", "collect_garbage", "registered_pods", "count_pods", "missing_pins", "build_id",
           "probe_kernel", "current_netns_cookie"]
