/* Helpers that decide, for one registered pod, what a socket's traffic means. */
#ifndef RDR_POLICY_H
#define RDR_POLICY_H

#include "redirect.h"

#define RDR_DNS_PORT 53

static __always_inline struct pod_policy *pod_of(__u64 netns)
{
	return pods.lookup(&netns);
}

static __always_inline int id_in(const struct id_range *r, __u32 n, __u32 id)
{
	/* Bounded, so the verifier sees the loop end; n is at most RDR_MAX_IDS. */
#pragma unroll
	for (int i = 0; i < RDR_MAX_IDS; i++) {
		if (i >= n)
			break;
		if (id >= r[i].lo && id <= r[i].hi)
			return 1;
	}
	return 0;
}

/* The proxy's own sockets (sidecar: uid/gid 1337) are never captured: that
 * is what keeps its connect to the original destination from looping. The
 * owner is the task calling connect/sendmsg, like iptables' owner match on
 * locally generated traffic. */
static __always_inline int is_proxy(const struct pod_policy *p)
{
	__u64 ug = bpf_get_current_uid_gid();

	return id_in(p->uids, p->n_uids, (__u32)ug) || id_in(p->gids, p->n_gids, (__u32)(ug >> 32));
}

static __always_inline int port_listed(__u64 netns, __u16 kind, __u16 port)
{
	struct port_key k = {.netns = netns, .kind = kind, .port = port};

	return ports.lookup(&k) != NULL;
}

static __always_inline int cidr_listed(__u64 netns, __u32 kind, const __u8 *addr, int v6)
{
	struct cidr_key k = {.prefixlen = 96 + (v6 ? 128 : 32), .kind = kind, .netns = netns};

	__builtin_memcpy(k.addr, addr, 16);
	return cidrs.lookup(&k) != NULL;
}

/* "Leaves over lo": without a route lookup (not available to sock_addr
 * programs) the loopback ranges stand for it. */
static __always_inline int is_v4_loopback(__u32 ip_be)
{
	return (bpf_ntohl(ip_be) >> 24) == 127;
}

static __always_inline int is_v6_loopback(const __u32 *ip)
{
	return ip[0] == 0 && ip[1] == 0 && ip[2] == 0 && ip[3] == bpf_htonl(1);
}

static __always_inline int is_v4_passthrough(__u32 ip_be)
{
	return ip_be == bpf_htonl(0x7f000006); /* 127.0.0.6: proxy inbound passthrough */
}

static __always_inline int is_v6_passthrough(const __u32 *ip)
{
	return ip[0] == 0 && ip[1] == 0 && ip[2] == 0 && ip[3] == bpf_htonl(6); /* ::6 */
}

#define RDR_PASS 0

/* Where a new outbound connection/datagram goes: RDR_PASS or the local port
 * to rewrite it to. Istio's OUTBOUND chain in order (redirect/plan.py). */
static __always_inline __u16 outbound_target(const struct pod_policy *p, __u64 netns, int tcp, __u16 port,
					     const __u8 *addr, int v6, int dst_loopback, int dst_is_lo_cidr,
					     int src_passthrough)
{
	int dns = (p->flags & RDR_F_DNS) && port == RDR_DNS_PORT;

	if (port_listed(netns, RDR_PORT_OUT_EXCL, port))
		return RDR_PASS;
	if (src_passthrough)
		return RDR_PASS;
	if (is_proxy(p))
		return RDR_PASS;
	if (dst_loopback && !(p->flags & RDR_F_INCL_LOOPBACK) && !(dns && tcp))
		return RDR_PASS;
	if (dns && ((p->flags & RDR_F_DNS_ALL) ||
		    cidr_listed(netns, v6 ? RDR_CIDR_DNS6 : RDR_CIDR_DNS4, addr, v6)))
		return p->dns_port;
	if (!tcp)
		return RDR_PASS; /* only DNS is captured for UDP */
	if (dst_is_lo_cidr)
		return RDR_PASS;
	if (cidr_listed(netns, v6 ? RDR_CIDR_OUT_EXCL6 : RDR_CIDR_OUT_EXCL4, addr, v6))
		return RDR_PASS;
	if (port_listed(netns, RDR_PORT_OUT_INCL, port))
		return p->proxy_port;
	if (p->flags & RDR_F_OUT_ALL)
		return p->proxy_port;
	if (cidr_listed(netns, v6 ? RDR_CIDR_OUT_INCL6 : RDR_CIDR_OUT_INCL4, addr, v6))
		return p->proxy_port;
	return RDR_PASS;
}

#endif
