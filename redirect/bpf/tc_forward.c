/* Forwarded TCP: tc programs on the interfaces of a pod that forwards.
 *
 * Netfilter's inbound capture (nat PREROUTING's REDIRECT, TPROXY's mangle PREROUTING) matches
 * whatever the destination, so it also takes what the pod forwards (forwarding on: a VM behind a
 * reroute interface connecting to other hosts, a neighbour routing through the pod). Forwarded
 * packets are routed before any socket lookup: sk_lookup (redirect/bpf/sk_lookup.c) never sees them. Here
 * the ingress program does what REDIRECT does to such a connection: when pod_listener (the one
 * statement of inbound capture, redirect/bpf/policy.h) takes it, its destination becomes a local address of
 * the pod (the pod's first address of the family, src4/src6 of the policy; REDIRECT takes the
 * interface's) and the chosen listener's port; the original destination is kept in orig_by_tuple
 * under the client's end, where the getsockopt program answers SO_ORIGINAL_DST from
 * (redirect/bpf/sockopt.c), and every later packet of the connection is rewritten alike. The egress program
 * rewrites the proxy's replies back (the source becomes the original destination), as conntrack's
 * reverse NAT does. Destinations of the pod's own (and loopback) are left to sk_lookup.
 *
 * The programs are attached as cls_bpf filters of a clsact qdisc on each interface the pod
 * forwards on (redirect/backends/ebpf/pod/tc.py), shared by every pod: a filter's classid is the pod's
 * pool slot plus one (the slot its sk_lookup program runs in, redirect/bpf/abi.h struct pool_slot), which
 * the kernel hands the program as skb->tc_classid before it runs; lookup_slots names the pod.
 *
 * Ethernet interfaces (veth, tap, bridges) and interfaces without a link-layer header (tun, IP
 * tunnels: RDR_TC_NO_L2 in the filter's classid); TCP whose header follows the IP header. TCP this
 * program cannot see whole (netfilter reassembles it before nat PREROUTING, and would capture it)
 * is dropped when forwarded, fail closed, never forwarded around the proxy: an IPv4 fragment of
 * TCP, and an IPv6 packet whose TCP header comes after extension headers or that carries a
 * Fragment header of TCP or of further extension headers (rdr_parse: RDR_PARSE_HIDDEN). To the
 * pod's own addresses such packets pass: the kernel reassembles them before sk_lookup judges.
 * Entries are LRU: a connection's is rewritten by the next SYN of the same client end.
 */
#include "policy.h"

#define RDR_ETH_HLEN 14
#define RDR_ETH_P_IP 0x0800
#define RDR_ETH_P_IPV6 0x86DD
#define RDR_TC_OK (-1) /* TC_ACT_UNSPEC: the interface's other filters run, then the packet goes on */
#define RDR_TC_SHOT 2 /* TC_ACT_SHOT */
#define RDR_TCP_SYN 0x02
#define RDR_TCP_ACK 0x10

/* rdr_parse's answers */
#define RDR_PARSE_OTHER 0  /* not TCP (or not IP): not this program's */
#define RDR_PARSE_TCP 1    /* TCP right after the IP header: all of *k is filled in */
#define RDR_PARSE_HIDDEN 2 /* TCP this program cannot see whole (only family and addresses filled in) */

/* IPv6 next headers: the extension headers walked to find what a packet carries. Encapsulating
 * Security Payload (50) and No Next Header (59) end the walk (not TCP that anyone could see). */
#define RDR_NH_HOPOPTS 0
#define RDR_NH_ROUTING 43
#define RDR_NH_FRAGMENT 44
#define RDR_NH_AH 51
#define RDR_NH_DSTOPTS 60
/* How many extension headers the walk reads before it gives up on a packet, counting it as hidden
 * TCP (fail closed: one with a longer chain, which no sender has a reason to make, is dropped
 * whatever it carries). */
#define RDR_IPV6_EXT_MAX 8

/* Where a TCP packet's fields are (offsets from the start of the packet: its Ethernet header, or
 * its IP header on an interface without a link-layer header). */
struct rdr_pkt {
	__u32 family;
	__u32 saddr_off; /* the destination follows the source: +4 (IPv4), +16 (IPv6) */
	__u32 l3_csum_off; /* IPv4 only */
	__u32 l4_off;
	__u8 saddr[16];
	__u8 daddr[16];
	__u16 sport_be;
	__u16 dport_be;
	__u8 flags;
};

/* What an IPv6 packet carries after extension headers (its IPv6 header at l3, next header nh):
 * RDR_PARSE_HIDDEN for TCP after them, or a Fragment header of TCP or of more extension headers
 * (the TCP header may not even be in this packet); else RDR_PARSE_OTHER. */
static __always_inline int rdr_ipv6_ext(struct __sk_buff *skb, __u32 l3, __u8 nh)
{
	__u32 off = l3 + 40;
	__u8 ext[2];
	int i;

#pragma unroll
	for (i = 0; i < RDR_IPV6_EXT_MAX; i++) {
		if (nh == IPPROTO_TCP)
			return RDR_PARSE_HIDDEN;
		if (nh != RDR_NH_HOPOPTS && nh != RDR_NH_ROUTING && nh != RDR_NH_FRAGMENT && nh != RDR_NH_AH &&
		    nh != RDR_NH_DSTOPTS)
			return RDR_PARSE_OTHER;
		if (bpf_skb_load_bytes(skb, off, ext, 2) < 0)
			return RDR_PARSE_HIDDEN; /* truncated: dropped, as the kernel would */
		if (nh == RDR_NH_FRAGMENT) {
			/* Whatever follows the first fragment's headers: TCP, or headers before it. */
			nh = ext[0];
			return nh == IPPROTO_TCP || nh == RDR_NH_HOPOPTS || nh == RDR_NH_ROUTING ||
					       nh == RDR_NH_FRAGMENT || nh == RDR_NH_AH || nh == RDR_NH_DSTOPTS
				       ? RDR_PARSE_HIDDEN
				       : RDR_PARSE_OTHER;
		}
		off += nh == RDR_NH_AH ? ((__u32)ext[1] + 2) * 4 : ((__u32)ext[1] + 1) * 8;
		nh = ext[0];
	}
	return nh == IPPROTO_TCP || nh == RDR_NH_HOPOPTS || nh == RDR_NH_ROUTING || nh == RDR_NH_FRAGMENT ||
			       nh == RDR_NH_AH || nh == RDR_NH_DSTOPTS
		       ? RDR_PARSE_HIDDEN
		       : RDR_PARSE_OTHER;
}

/* The TCP packet's addresses, ports and flags, its IP header l2 bytes in (RDR_ETH_HLEN, or 0):
 * RDR_PARSE_TCP; RDR_PARSE_HIDDEN (family and addresses only) for TCP it cannot see whole;
 * RDR_PARSE_OTHER for a packet this program does not handle. */
static __always_inline int rdr_parse(struct __sk_buff *skb, struct rdr_pkt *k, __u32 l2)
{
	__u8 hdr[40];
	__u16 ports[2];
	int what;

	if (skb->protocol == bpf_htons(RDR_ETH_P_IP)) {
		if (bpf_skb_load_bytes(skb, l2, hdr, 20) < 0)
			return RDR_PARSE_OTHER;
		if ((hdr[0] >> 4) != 4 || hdr[9] != IPPROTO_TCP)
			return RDR_PARSE_OTHER;
		k->family = AF_INET;
		__builtin_memcpy(k->saddr, hdr + 12, 4);
		__builtin_memcpy(k->daddr, hdr + 16, 4);
		/* A fragment (more-fragments or an offset): its ports are in the first one only. */
		if ((hdr[6] & 0x3f) || hdr[7])
			return RDR_PARSE_HIDDEN;
		k->saddr_off = l2 + 12;
		k->l3_csum_off = l2 + 10;
		k->l4_off = l2 + (hdr[0] & 0xf) * 4;
	} else if (skb->protocol == bpf_htons(RDR_ETH_P_IPV6)) {
		if (bpf_skb_load_bytes(skb, l2, hdr, 40) < 0)
			return RDR_PARSE_OTHER;
		if ((hdr[0] >> 4) != 6)
			return RDR_PARSE_OTHER;
		if (hdr[6] != IPPROTO_TCP) {
			what = rdr_ipv6_ext(skb, l2, hdr[6]);
			if (what == RDR_PARSE_OTHER)
				return RDR_PARSE_OTHER;
		}
		k->family = AF_INET6;
		__builtin_memcpy(k->saddr, hdr + 8, 16);
		__builtin_memcpy(k->daddr, hdr + 24, 16);
		if (hdr[6] != IPPROTO_TCP)
			return RDR_PARSE_HIDDEN;
		k->saddr_off = l2 + 8;
		k->l4_off = l2 + 40;
	} else {
		return RDR_PARSE_OTHER;
	}
	if (bpf_skb_load_bytes(skb, k->l4_off, ports, 4) < 0 || bpf_skb_load_bytes(skb, k->l4_off + 13, &k->flags, 1) < 0)
		return RDR_PARSE_OTHER;
	k->sport_be = ports[0];
	k->dport_be = ports[1];
	return RDR_PARSE_TCP;
}

/* Rewrite one end (the source: src 1; the destination: 0) of the packet to addr:port_be, with the
 * IP (IPv4) and TCP checksums. */
static __always_inline int rdr_rewrite(struct __sk_buff *skb, const struct rdr_pkt *k, int src, const __u8 *addr,
				       __u16 port_be)
{
	__u32 csum = k->l4_off + 16;
	__u32 aoff = k->saddr_off + (src ? 0 : (k->family == AF_INET ? 4 : 16));
	__u32 poff = k->l4_off + (src ? 0 : 2);
	__u16 old_port = src ? k->sport_be : k->dport_be;
	const __u8 *old = src ? k->saddr : k->daddr;

	if (k->family == AF_INET) {
		__u32 from, to;

		__builtin_memcpy(&from, old, 4);
		__builtin_memcpy(&to, addr, 4);
		if (bpf_l4_csum_replace(skb, csum, from, to, BPF_F_PSEUDO_HDR | 4) < 0 ||
		    bpf_l3_csum_replace(skb, k->l3_csum_off, from, to, 4) < 0 ||
		    bpf_skb_store_bytes(skb, aoff, &to, 4, 0) < 0)
			return -1;
	} else {
		__u32 from[4], to[4];
		__s64 diff;

		__builtin_memcpy(from, old, 16);
		__builtin_memcpy(to, addr, 16);
		diff = bpf_csum_diff(from, 16, to, 16, 0);
		if (diff < 0 || bpf_l4_csum_replace(skb, csum, 0, (__u32)diff, BPF_F_PSEUDO_HDR) < 0 ||
		    bpf_skb_store_bytes(skb, aoff, to, 16, 0) < 0)
			return -1;
	}
	if (bpf_l4_csum_replace(skb, csum, old_port, port_be, 2) < 0 ||
	    bpf_skb_store_bytes(skb, poff, &port_be, 2, 0) < 0)
		return -1;
	return 0;
}

/* Whether two addresses (16 bytes, IPv4 in the first 4 and zeros after) are equal. */
static __always_inline int rdr_same_addr(const __u8 *a, const __u8 *b)
{
	__u32 x[4], y[4];

	__builtin_memcpy(x, a, 16);
	__builtin_memcpy(y, b, 16);
	return x[0] == y[0] && x[1] == y[1] && x[2] == y[2] && x[3] == y[3];
}

static __always_inline int rdr_has_addr(const __u8 *a, int v6)
{
	__u32 w[4] = {};

	if (v6)
		__builtin_memcpy(w, a, 16);
	else
		__builtin_memcpy(w, a, 4);
	return (w[0] | w[1] | w[2] | w[3]) != 0;
}

/* A TCP packet (parsed into *k, *what says how far: rdr_parse) of the registered pod whose filter
 * runs the program: lookup_slots[tc_classid - 1] (RDR_TC_NO_L2 aside); NULL for any other packet.
 * The parse comes first: no map look-up for what is not TCP. */
static __always_inline struct pod_policy *filter_pod(struct __sk_buff *skb, struct rdr_pkt *k, int *what,
						     __u64 *netns, __u64 *keys)
{
	struct pod_policy *p;
	struct pool_slot *ps;
	__u32 slot = skb->tc_classid & ~(__u32)RDR_TC_NO_L2;

	*what = rdr_parse(skb, k, skb->tc_classid & RDR_TC_NO_L2 ? 0 : RDR_ETH_HLEN);
	if (*what == RDR_PARSE_OTHER || slot == 0)
		return 0;
	slot--;
	ps = lookup_slots.lookup(&slot);
	if (!ps)
		return 0;
	*netns = ps->netns;
	p = pod_of(*netns);
	if (!p)
		return 0;
	*keys = pod_keys(p, *netns);
	return p;
}

int rdr_tc_ingress(struct __sk_buff *skb)
{
	struct rdr_pkt k = {};
	struct tuple_key client = {};
	struct orig_dst o = {}, *seen;
	struct pod_policy *p;
	__u64 netns, keys;
	const __u8 *local;
	int v6, kind, spoofed, what;
	__u16 to;

	p = filter_pod(skb, &k, &what, &netns, &keys);
	if (!p)
		return RDR_TC_OK;
	v6 = k.family == AF_INET6;
	if (v6 && !(p->flags & RDR_F_V6))
		return RDR_TC_OK;
	/* To the pod itself: sk_lookup's (there with the original destination as the local address;
	 * the kernel reassembles fragments first). */
	if (own_address(p, keys, k.daddr, v6))
		return RDR_TC_OK;
	/* Forwarded TCP whose ports this program cannot read (a fragment, extension headers), which
	 * netfilter would reassemble and capture: never forwarded around the proxy (fail closed). */
	if (what != RDR_PARSE_TCP)
		return RDR_TC_SHOT;
	/* From an address of the pod's own, or loopback (spoofed: nothing behind the interface has
	 * one): never an entry, whose key could be one of the pod's own connections' (redirect/bpf/sockopt.c). */
	spoofed = own_address(p, keys, k.saddr, v6);
	client.netns = netns;
	client.family = k.family;
	client.port_be = k.sport_be;
	__builtin_memcpy(client.addr, k.saddr, 16);
	local = v6 ? p->src6 : p->src4;
	if ((k.flags & (RDR_TCP_SYN | RDR_TCP_ACK)) == RDR_TCP_SYN) {
		/* A new connection: REDIRECT's choice (nat PREROUTING runs for its first packet). */
		kind = pod_listener(p, keys, bpf_ntohs(k.dport_be), skb->ifindex, v6, k.saddr, k.daddr, 1);
		if (kind < 0) {
			if (!spoofed)
				orig_by_tuple.delete(&client); /* (a stale entry of an earlier connection) */
			return RDR_TC_OK;
		}
		/* Captured, but from a source that can't be given an entry: never around the proxy
		 * (fail closed; IPv4 drops such a martian source anyway, IPv6 would forward it). */
		if (spoofed)
			return RDR_TC_SHOT;
		to = kind == RDR_LISTENER_INBOUND ? p->inbound_port : p->proxy_port;
		/* No address of the family to deliver it to: never around the proxy (fail closed). */
		if (!rdr_has_addr(local, v6))
			return RDR_TC_SHOT;
		o.netns = netns;
		o.family = k.family;
		o.port_be = k.dport_be;
		o.via_port = to;
		__builtin_memcpy(o.addr, k.daddr, 16);
		orig_by_tuple.update(&client, &o);
	} else {
		if (spoofed)
			return RDR_TC_OK;
		seen = orig_by_tuple.lookup(&client);
		if (!seen || seen->port_be != k.dport_be || !rdr_same_addr(seen->addr, k.daddr))
			return RDR_TC_OK; /* not a connection this program redirected */
		to = seen->via_port;
	}
	if (rdr_rewrite(skb, &k, 0, local, bpf_htons(to)) < 0)
		return RDR_TC_SHOT;
	return RDR_TC_OK;
}

int rdr_tc_egress(struct __sk_buff *skb)
{
	struct rdr_pkt k = {};
	struct tuple_key client = {};
	struct orig_dst *o;
	struct pod_policy *p;
	__u64 netns, keys;
	__u8 addr[16];
	int what;

	/* (The proxy's replies are whole TCP segments: anything else is not one.) */
	p = filter_pod(skb, &k, &what, &netns, &keys);
	if (!p || what != RDR_PARSE_TCP)
		return RDR_TC_OK;
	client.netns = netns;
	client.family = k.family;
	client.port_be = k.dport_be;
	__builtin_memcpy(client.addr, k.daddr, 16);
	o = orig_by_tuple.lookup(&client);
	/* The proxy's side of a redirected connection: from the address and port it was redirected to. */
	if (!o || bpf_htons(o->via_port) != k.sport_be)
		return RDR_TC_OK;
	if (k.family == AF_INET6)
		__builtin_memcpy(addr, p->src6, 16);
	else {
		__builtin_memset(addr, 0, 16);
		__builtin_memcpy(addr, p->src4, 4);
	}
	if (!rdr_same_addr(k.saddr, addr))
		return RDR_TC_OK;
	__builtin_memcpy(addr, o->addr, 16);
	if (rdr_rewrite(skb, &k, 1, addr, o->port_be) < 0)
		return RDR_TC_SHOT;
	return RDR_TC_OK;
}
