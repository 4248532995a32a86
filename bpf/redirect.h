/* Shared types and maps of the redirect eBPF backend.
 *
 * Every program here is attached host-wide (cgroup v2 root) or to a pod's
 * netns, and must be a strict no-op for any socket whose network namespace
 * cookie is not a key of `pods`: other processes on this host (and other
 * backends' tests) run under the same programs.
 *
 * The layouts below are mirrored byte for byte by redirect/backends/ebpf.py
 * (struct formats next to each name there). Addresses are stored in network
 * byte order as 16 raw bytes (IPv4 in the first 4); ports in host order
 * unless the field name says _be.
 */
#ifndef RDR_REDIRECT_H
#define RDR_REDIRECT_H

#include <uapi/linux/bpf.h>
#include <uapi/linux/in.h>
#include <uapi/linux/in6.h>
#include <linux/socket.h>

/* Socket types, from include/linux/net.h (not a uapi header). */
#ifndef SOCK_STREAM
#define SOCK_STREAM 1
#define SOCK_DGRAM 2
#endif

#define RDR_MAX_IDS 8

/* pod_policy.flags */
#define RDR_F_OUT_ALL         (1U << 0) /* outbound_cidrs == "*" */
#define RDR_F_DNS             (1U << 1) /* DNS capture on (dns_effective) */
#define RDR_F_DNS_ALL         (1U << 2) /* capture_all_dns */
#define RDR_F_INCL_LOOPBACK   (1U << 3) /* an included CIDR is loopback: app lo traffic is not returned */
#define RDR_F_INBOUND         (1U << 4) /* inbound capture on */
#define RDR_F_INBOUND_ALL     (1U << 5) /* inbound_ports == "*" */
#define RDR_F_V6              (1U << 6) /* IPv6 is captured too */

/* ports.kind */
#define RDR_PORT_OUT_EXCL 1
#define RDR_PORT_OUT_INCL 2
#define RDR_PORT_IN_INCL  3
#define RDR_PORT_IN_EXCL  4

/* cidrs.kind: family-specific, so one trie serves both families */
#define RDR_CIDR_OUT_EXCL4 1
#define RDR_CIDR_OUT_INCL4 2
#define RDR_CIDR_DNS4      3
#define RDR_CIDR_OUT_EXCL6 4
#define RDR_CIDR_OUT_INCL6 5
#define RDR_CIDR_DNS6      6
#define RDR_CIDR_LOCAL4    7 /* the pod's own addresses: a connect to them leaves over lo */
#define RDR_CIDR_LOCAL6    8

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
	__u32 n_uids;
	__u32 n_gids;
	__u32 inv_base; /* this pod's inventory entries are inventory[netns, inv_base + i], i < n_inv */
	__u32 n_inv;
	struct id_range uids[RDR_MAX_IDS];
	struct id_range gids[RDR_MAX_IDS];
	__u32 groups_mode; /* RDR_GROUPS_*: owner_groups / owner_groups_exclude */
	__u32 n_groups;
	struct id_range groups[RDR_MAX_IDS];
};

#define RDR_GROUPS_ALL     0 /* owner_groups = "*" */
#define RDR_GROUPS_ONLY    1 /* only these groups are captured */
#define RDR_GROUPS_EXCLUDE 2 /* these groups are not captured */

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
};

/* The client end of a connection to the proxy, as the proxy's accepted
 * socket sees its peer. */
struct tuple_key {
	__u64 netns;
	__u32 family;
	__u16 port_be;
	__u16 _pad;
	__u8 addr[16];
};

struct listener_key {
	__u64 netns;
	__u32 family;
	__u32 _pad;
};

/* What one pod owns in ports/cidrs, so teardown and check touch
 * only that pod's entries instead of walking whole maps: key i of the pod
 * is in entry (netns, inv_base + i / RDR_INV_CHUNK). Only userspace reads
 * and writes it. */
struct inv_key {
	__u64 netns;
	__u32 idx;
	__u32 _pad;
};

#define RDR_INV_PORTS 1
#define RDR_INV_CIDRS 2

#define RDR_INV_CHUNK 8 /* keys per entry: a typical pod has one */

struct inv_val {
	__u32 map[RDR_INV_CHUNK];     /* RDR_INV_*, 0 = unused */
	__u8 key[RDR_INV_CHUNK][32]; /* the keys in those maps, zero-padded */
};

BPF_HASH(pods, __u64, struct pod_policy, 4096);
BPF_F_TABLE("hash", struct inv_key, struct inv_val, inventory, 65536, BPF_F_NO_PREALLOC);
BPF_HASH(ports, struct port_key, __u8, 65536);
BPF_LPM_TRIE(cidrs, struct cidr_key, __u8, 65536);
/* sk_lookup can't ask for its netns cookie (the verifier refuses
 * bpf_get_netns_cookie there), so each pod's netns gets a program of its own,
 * a stub that holds the cookie as a constant (native/redirect_native.c,
 * rdr_ebpf_lookup_prog): it stores it in lookup_netns and tail-calls
 * rdr_sk_lookup (lookup_prog[0]), which reads it back and zeroes it. TCP's
 * lookups run with bottom halves off, so nothing else runs on that CPU in
 * between; a run that interrupts another (a lookup from process context)
 * completes, and leaves the slot zero, never another pod's cookie. */
BPF_PERCPU_ARRAY(lookup_netns, __u64, 1);
BPF_PROG_ARRAY(lookup_prog, 1);
/* Staging: socket cookie -> original dst, from connect4/6 until sock_ops
 * sees the local port (TCP_CONNECT_CB). LRU, so a connect that fails before
 * then can't leak an entry forever. */
BPF_TABLE("lru_hash", __u64, struct orig_dst, orig_by_cookie, 65536);
/* Client 4-tuple half -> original dst, read by the getsockopt program. */
BPF_TABLE("lru_hash", struct tuple_key, struct orig_dst, orig_by_tuple, 65536);
/* UDP DNS: socket cookie -> the server the app asked, for recvmsg4/6. */
BPF_TABLE("lru_hash", __u64, struct orig_dst, dns_by_cookie, 65536);
/* The proxy's inbound listeners, per pod and family. bcc's BPF_SOCKHASH
 * has no .lookup() (sk_lookup needs it) and BPF_TABLE("sockhash") no
 * .sock_hash_update() (sock_ops needs it): declared by hand with both, the
 * way bcc's helpers.h declares tables (its rewriter goes by member name). */
struct listeners_table_t {
	struct listener_key key;
	__u64 leaf;
	__u64 *(*lookup)(struct listener_key *);
	int (*update)(struct listener_key *, __u64 *);
	int (*delete)(struct listener_key *);
	int (*sock_hash_update)(void *, void *, u64);
	u32 max_entries;
};
__attribute__((section("maps/sockhash"))) struct listeners_table_t listeners = {.max_entries = 8192};
BPF_ANNOTATE_KV_PAIR(listeners, struct listener_key, __u64);

#endif
