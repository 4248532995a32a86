/* The eBPF backend's ABI: the layouts of the map keys and values, and their
 * constants, in one place. Included by the BPF programs (redirect/bpf/redirect.h), by
 * the native helpers (native/pod_setup.c) and given to cffi's cdef
 * (native/build_native.py), from which redirect/backends/ebpf/abi.py takes its
 * sizes, offsets and struct formats: a layout is changed here, once.
 *
 * Plain C for all three readers: fixed-width __uN types, no padding the
 * compiler would add (explicit _pad fields), constants as plain integers
 * (cffi's cdef reads only "#define NAME <integer>", and is given kinds.h itself). Addresses are stored in
 * network byte order as 16 raw bytes (IPv4 in the first 4); ports in host
 * order unless the field name says _be.
 */
#ifndef RDR_ABI_H
#define RDR_ABI_H

#include <linux/types.h>

/* pod_policy.flags: each is the boolean of redirect/plan/lower_ebpf.py's EbpfPolicy of its name
 * (RDR_F_<NAME>), which redirect/backends/ebpf/pod/entries.py packs by that name. */
#define RDR_F_OUT_ALL 0x1        /* outbound_cidrs == "*" */
#define RDR_F_DNS 0x2            /* DNS capture on (dns_effective) */
#define RDR_F_DNS_ALL 0x4        /* capture_all_dns */
#define RDR_F_LO_RETURN 0x8      /* others' lo traffic returns at the proxy owners' rules (see nat_target) */
#define RDR_F_INBOUND 0x10       /* inbound capture on */
#define RDR_F_INBOUND_ALL 0x20   /* inbound_ports == "*" */
#define RDR_F_V6 0x40            /* IPv6 is captured too */
#define RDR_F_TPROXY 0x80        /* inbound_interception = TPROXY (see outbound_target) */
#define RDR_F_EXCL_IF 0x100      /* exclude_interfaces: RDR_CIDR_IFACE_EXCLUDE / VIA_EXCLUDE* entries count */
#define RDR_F_AMBIENT 0x200      /* mode = ambient: the node proxy's marks (proxy_mark...), not owners */
#define RDR_F_REROUTE_IF 0x400   /* reroute_interfaces: RDR_CIDR_IFACE_REROUTE entries count */
#define RDR_F_LO_RETURN_SPARES_DNS 0x800 /* that lo return leaves DNS (UDP, TCP to resolver_port) alone */
#define RDR_F_SOCKMAP 0x1000     /* sockmap: the two ends of the pod's app <-> proxy connections are
				  * paired in the `pairs` sockhash (redirect/bpf/sockmap.c) */
/* Bookkeeping of user space only (no program reads it): this pod's setup turned the netns's
 * net.ipv4.tcp_fwmark_accept on (ambient, TPROXY), so its teardown turns it off again. */
#define RDR_F_FWMARK_ACCEPT_OURS 0x80000000

/* pod_policy.groups_mode: owner_groups / owner_groups_exclude */
#define RDR_GROUPS_ALL 0     /* owner_groups = "*" */
#define RDR_GROUPS_ONLY 1    /* only these groups are captured */
#define RDR_GROUPS_EXCLUDE 2 /* these groups are not captured */

/* port_key.kind, cidr_key.kind (RDR_PORT_*, RDR_CIDR_*): kinds.h, generated from the kind table
 * of redirect/plan/lower_ebpf.py. CIDR kinds are family-specific, so one trie serves both
 * families; owner ids past a kind's first range (any number) are prefix blocks of the id in
 * network order in addr's first 4 bytes, prefix 0-32 (an IPv4-shaped key), and so is an
 * interface's ifindex (/32), resolved in the pod at setup (exclude_interfaces, reroute_interfaces:
 * redirect/plan/lower_ebpf.py, pod_interfaces). */
#include "kinds.h"

/* cidr_key.prefixlen = RDR_CIDR_PREFIX_BASE + the CIDR's own prefix length */
#define RDR_CIDR_PREFIX_BASE 96

/* pod_policy.hairpin_*_skip: room for the ports one owner kind's hairpin leaves alone */
#define RDR_HAIRPIN_SKIP_MAX 2

struct id_range {
	__u32 lo;
	__u32 hi;
};

/* One per pod, keyed by netns cookie: the pod is "registered" iff present. */
struct pod_policy {
	__u16 proxy_port;
	__u16 inbound_port;
	__u16 tunnel_port;
	__u16 dns_port;
	__u32 flags;
	__u32 lo4_addr; /* ipv4_loopback_cidr, network order */
	__u32 lo4_mask;
	__u32 n_uids; /* ranges of proxy_uids: the first is uid0, the others RDR_CIDR_UID entries */
	__u32 n_gids; /* likewise gid0 and RDR_CIDR_GID */
	__u32 inv_base; /* this pod's inventory entries are inventory[netns, inv_base + i], i < n_inv;
			 * 0 or 1 << 31, the pod's generation: its ports/cidrs entries are keyed under
			 * the netns cookie, with bit 63 set in the second (policy.h, pod_keys) */
	__u32 n_inv;
	struct id_range uid0;
	struct id_range gid0;
	__u32 groups_mode; /* RDR_GROUPS_* */
	__u32 n_groups; /* the first is group0, the others RDR_CIDR_GROUP entries */
	struct id_range group0;
	__u32 tproxy_mark; /* with RDR_F_TPROXY: a socket with this mark is the proxy's to the app */
	/* The source an unbound socket's connect gets for a destination off the pod: the pod's first
	 * address of the family (not on lo), network order; zero: none. The connect and sendmsg hooks
	 * give it to a socket they send to the proxy, so both ends see the address iptables shows. */
	__u8 src4[4];
	__u8 src6[16];
	/* With RDR_F_AMBIENT: a socket whose mark & mark_mask is proxy_mark is the node proxy's;
	 * conn_mark (under mark_mask) is what its transparent connections to the app carry
	 * (redirect/bpf/sockopt.c, local_connect), routed back to it by the policy route. */
	__u32 proxy_mark;
	__u32 mark_mask;
	__u32 conn_mark;
	/* DNS capture takes UDP and TCP to this port (53). */
	__u16 resolver_port;
	/* Per owner kind, the ports the proxy's lo hairpin to inbound capture leaves alone (the tunnel
	 * port; the resolver port with DNS capture); a list shorter than the room repeats its first. */
	__u16 hairpin_uid_skip[RDR_HAIRPIN_SKIP_MAX];
	__u16 hairpin_gid_skip[RDR_HAIRPIN_SKIP_MAX];
	__u16 _pad;
	/* The source of the proxy's inbound passthrough (127.0.0.6, ::6), network order: its
	 * connections over lo are never captured. */
	__u8 passthrough4[4];
	__u8 passthrough6[16];
	/* The plan's policy route (``local default dev lo``): a socket whose mark & route_mask is
	 * route_mark is delivered in the pod whatever its destination, so it leaves over lo (TPROXY's
	 * tproxy_mark; ambient's conn_mark). route_mask 0: no such route. */
	__u32 route_mark;
	__u32 route_mask;
	/* The pod's first IPv6 link-local address (with IPv6 captured), network order; zero: none. One of
	 * the pod's own addresses as its RDR_CIDR_LOCAL6 entries are (policy.h, own_address), held here so
	 * that the one a pod usually has (its interface's) costs no map entry; any other is an entry. */
	__u8 ll6[16];
};

struct port_key {
	__u64 netns;
	__u16 kind;
	__u16 port;
	__u32 _pad;
};

/* LPM trie key: the prefix covers kind and netns (always 96 bits) plus the
 * CIDR's own prefix, so a lookup never matches another pod or family. */
struct cidr_key {
	__u32 prefixlen;
	__u32 kind;
	__u64 netns;
	__u8 addr[16];
};

/* The destination a socket asked for, before we rewrote it. */
struct orig_dst {
	__u64 netns;
	__u32 family;   /* AF_INET or AF_INET6 */
	__u16 port_be;
	__u16 via_port; /* the port we sent it to (host order) */
	__u8 addr[16];
	__u32 flags;    /* RDR_ORIG_* */
	__u32 _pad;
};

/* orig_dst.flags: the proxy's side of the connection is established, and its close (not the
 * app's) removes the orig_by_tuple entry (redirect/bpf/sockopt.c). */
#define RDR_ORIG_ACCEPTED 0x1
/* The pod had sockmap on when its connect4/6 took the connection to the proxy: a pair candidate. */
#define RDR_ORIG_PAIR 0x2

/* The client end of a connection to the proxy, as the proxy's accepted
 * socket sees its peer (an IPv4-mapped address as IPv4). */
struct tuple_key {
	__u64 netns;
	__u32 family;
	__u16 port_be;
	__u16 _pad;
	__u8 addr[16];
};

/* sockmap (redirect/bpf/sockmap.c): one end of a TCP connection inside a pod, as its own socket
 * sees it (an IPv4-mapped address as IPv4; ports in network order). The key of the `pairs`
 * sockhash, and of `pair_state` under the connecting end's view. */
struct pair_key {
	__u64 netns;
	__u32 family;
	__u16 lport_be;
	__u16 rport_be;
	__u8 laddr[16];
	__u8 raddr[16];
};

/* pair_state.state: how far the pairing of one connection went. */
#define RDR_PAIR_PENDING 1 /* the connecting end is a candidate (sock_ops TCP_CONNECT_CB) */
#define RDR_PAIR_OPEN 2    /* it joined `pairs` at ACTIVE_ESTABLISHED_CB: the accepted end may join */
#define RDR_PAIR_JOINED 3  /* the accepted end joined too: both ends are paired for good */
#define RDR_PAIR_TCP 4     /* a send of the connecting end found no peer and went over TCP: the
			    * accepted end stays out and the connecting end leaves `pairs` */
#define RDR_PAIR_LEFT 5    /* ... which it did */

/* pair_state.state: the RDR_PAIR_* under this mask; above it, from ACTIVE_ESTABLISHED_CB on, the
 * connection's identity: the connecting end's snd_nxt then (its ISN + 1), shifted left 32. */
#define RDR_PAIR_STATE_MASK 0xff

/* The connection's pairing, keyed by the connecting end's pair_key, for as long as the connecting
 * end lives. The accepted end joins only if the handshake's sequence numbers match (an entry of
 * an earlier connection with the same addresses never counts); the two ends settle OPEN -> JOINED
 * or OPEN -> TCP by one atomic compare-and-swap on state (64 bits: what bcc compiles), which also
 * compares the connection's identity: a compare-and-swap on an entry that meanwhile went and was
 * reused for another connection fails. */
struct pair_state {
	__u64 state; /* RDR_PAIR_* | identity (RDR_PAIR_STATE_MASK) */
	__u32 isn_a; /* the connecting end's rcv_nxt at ACTIVE_ESTABLISHED_CB: the accepted end's ISN + 1 */
	__u32 _pad;
};

/* listener_key.kind: which of the proxy's listeners sk_lookup hands connections to */
#define RDR_LISTENER_INBOUND 0  /* on inbound_port: inbound capture */
#define RDR_LISTENER_OUTBOUND 1 /* on proxy_port: inbound arriving on a reroute interface */

struct listener_key {
	__u64 netns;
	__u32 family;
	__u32 kind; /* RDR_LISTENER_* */
};

/* What one pod owns in ports/cidrs, so teardown and check touch only that
 * pod's entries instead of walking whole maps: key i of the pod is in entry
 * (netns, inv_base + i / RDR_INV_CHUNK). Only userspace reads and writes it. */
struct inv_key {
	__u64 netns;
	__u32 idx;
	__u32 _pad;
};

#define RDR_INV_PORTS 1 /* inv_val.map: the key is a port_key */
#define RDR_INV_CIDRS 2 /* a cidr_key */

#define RDR_INV_CHUNK 8    /* keys per entry: a typical pod has one */
#define RDR_INV_KEY_MAX 32 /* the largest key an entry holds */

struct inv_val {
	__u32 map[RDR_INV_CHUNK];                  /* RDR_INV_*, 0 = unused */
	__u8 key[RDR_INV_CHUNK][RDR_INV_KEY_MAX]; /* the keys in those maps, zero-padded */
};

/* The pods' sk_lookup programs come from a pool loaded ahead (native/redirect_native.c,
 * rdr_ebpf_pool_prog): program `slot` reads its pod from lookup_slots[slot], which the pod's
 * setup claims (BPF_NOEXIST) and its teardown or the garbage collection releases. */
#define RDR_POOL_MAX 8192 /* slots, and programs in lookup_pool */

/* A pod's tc filters carry its pool slot plus one in their classid's minor (below RDR_TC_NO_L2,
 * since RDR_POOL_MAX is), and this bit when the interface's packets have no link-layer header (a
 * tun or IP tunnel device: the IP header comes first), so tc_forward.c knows where it starts. */
#define RDR_TC_NO_L2 0x8000

struct pool_slot {
	__u64 netns;     /* the cookie of the netns the slot's program is linked to */
	__u64 netns_ino; /* its inode: the byte of the netns lock a setup holds while it claims */
};

#endif
