/* Helpers that decide, for one registered pod, what a socket's traffic means. */
#ifndef RDR_POLICY_H
#define RDR_POLICY_H

#include "redirect.h"

static __always_inline struct pod_policy *pod_of(__u64 netns)
{
	return pods.lookup(&netns);
}

/* The netns value the pod's ports/cidrs entries are keyed under ("keys" below): its netns
 * cookie, with bit 63 set for the second generation (redirect/bpf/abi.h, pod_policy.inv_base). A changed
 * config's entries are written in the other generation, where the live policy never looks, and
 * the one policy write switches to all of them at once. */
static __always_inline __u64 pod_keys(const struct pod_policy *p, __u64 netns)
{
	return netns ^ ((__u64)(p->inv_base >> 31) << 63);
}

static __always_inline int port_listed(__u64 keys, __u16 kind, __u16 port)
{
	struct port_key k = {.netns = keys, .kind = kind, .port = port};

	return ports.lookup(&k) != NULL;
}

static __always_inline int cidr_listed(__u64 keys, __u32 kind, const __u8 *addr, int v6)
{
	struct cidr_key k = {.prefixlen = RDR_CIDR_PREFIX_BASE + (v6 ? 128 : 32), .kind = kind, .netns = keys};

	__builtin_memcpy(k.addr, addr, 16);
	return cidrs.lookup(&k) != NULL;
}

/* Whether ifindex has an entry of kind (RDR_CIDR_IFACE_EXCLUDE, RDR_CIDR_IFACE_REROUTE) in the pod. */
static __always_inline int iface_listed(__u64 keys, __u32 kind, __u32 ifindex)
{
	__u32 be = bpf_htonl(ifindex);
	__u8 addr[16] = {};

	if (ifindex == 0)
		return 0;
	__builtin_memcpy(addr, &be, 4);
	return cidr_listed(keys, kind, addr, 0);
}

/* Whether ifindex is one of the pod's excluded interfaces (exclude_interfaces). */
static __always_inline int iface_excluded(const struct pod_policy *p, __u64 keys, __u32 ifindex)
{
	return (p->flags & RDR_F_EXCL_IF) && iface_listed(keys, RDR_CIDR_IFACE_EXCLUDE, ifindex);
}

/* Whether ifindex is one of the pod's reroute (kube-virt) interfaces (reroute_interfaces). */
static __always_inline int iface_rerouted(const struct pod_policy *p, __u64 keys, __u32 ifindex)
{
	return (p->flags & RDR_F_REROUTE_IF) && iface_listed(keys, RDR_CIDR_IFACE_REROUTE, ifindex);
}

/* Whether the connection leaves through an excluded interface (Istio's "-o <if> -j RETURN",
 * first in OUTPUT): the device its socket is bound to, else the interface the pod's main table
 * routes the destination through (entries written at setup; check reports when they change).
 * Traffic over lo never leaves through one. */
static __always_inline int leaves_excluded(const struct pod_policy *p, __u64 keys, const __u8 *addr, int v6,
					   int out_lo, __u32 bound_if)
{
	if (!(p->flags & RDR_F_EXCL_IF) || out_lo)
		return 0;
	if (bound_if)
		return iface_excluded(p, keys, bound_if);
	return cidr_listed(keys, v6 ? RDR_CIDR_VIA_EXCLUDE6 : RDR_CIDR_VIA_EXCLUDE4, addr, v6);
}

/* Whether id is in one kind's ranges: the first (inline in the policy, all a
 * pod with one range needs), else its other n - 1 in the cidrs trie. */
static __always_inline int id_listed(__u64 keys, __u32 kind, const struct id_range *first, __u32 n, __u32 id)
{
	__u32 be = bpf_htonl(id);
	__u8 addr[16] = {};

	if (n == 0)
		return 0;
	if (id >= first->lo && id <= first->hi)
		return 1;
	if (n == 1)
		return 0;
	__builtin_memcpy(addr, &be, 4);
	return cidr_listed(keys, kind, addr, 0);
}

#define RDR_OWN_NEXT 0
#define RDR_OWN_PASS 1
#define RDR_OWN_INBOUND 2

/* Whether port is one of the ports an owner kind's hairpin leaves alone (skip: its
 * RDR_HAIRPIN_SKIP_MAX entries of the policy). */
static __always_inline int hairpin_skips(const __u16 *skip, __u16 port)
{
	int i;

#pragma unroll
	for (i = 0; i < RDR_HAIRPIN_SKIP_MAX; i++)
		if (port == skip[i])
			return 1;
	return 0;
}

/* One owner kind's three rules of Istio's OUTPUT chain, per uid/gid range in
 * order (redirect/plan/sidecar.py, "proxy uid hairpin over lo" / "app traffic over lo" /
 * "proxy uid"): the proxy's lo traffic to a non-loopback address goes to
 * inbound capture (hairpin: TCP, not to the loopback range; skip: the ports the kind's
 * hairpin leaves alone); anyone else's lo traffic returns; the proxy returns. With
 * lo_return the first range's rules decide every lo connection (whoever is
 * not in it returns there); otherwise only membership in some range counts. */
static __always_inline int owner_rules(__u64 keys, __u32 kind, const struct id_range *first, __u32 n, __u32 id,
				       int out_lo, int hairpin, const __u16 *skip, __u16 port, int lo_return)
{
	if (n == 0)
		return RDR_OWN_NEXT;
	if (out_lo && lo_return) {
		if (id >= first->lo && id <= first->hi && hairpin && !hairpin_skips(skip, port))
			return RDR_OWN_INBOUND;
		return RDR_OWN_PASS;
	}
	if (!id_listed(keys, kind, first, n, id))
		return RDR_OWN_NEXT;
	return out_lo && hairpin && !hairpin_skips(skip, port) ? RDR_OWN_INBOUND : RDR_OWN_PASS;
}

/* "Leaves over lo" (iptables' -o lo) without a route lookup, which sock_addr
 * programs can't do: the destination is loopback or one of the pod's own
 * addresses (RDR_CIDR_LOCAL*, written at setup). */
static __always_inline int is_v4_loopback(__u32 ip_be)
{
	return (bpf_ntohl(ip_be) >> 24) == 127;
}

static __always_inline int is_v6_loopback(const __u32 *ip)
{
	return ip[0] == 0 && ip[1] == 0 && ip[2] == 0 && ip[3] == bpf_htonl(1);
}

/* Whether a source is the proxy's inbound passthrough address (pod_policy.passthrough4/6). */
static __always_inline int is_v4_passthrough(const struct pod_policy *p, __u32 ip_be)
{
	__u32 pass;

	__builtin_memcpy(&pass, p->passthrough4, 4);
	return ip_be == pass;
}

static __always_inline int is_v6_passthrough(const struct pod_policy *p, const __u32 *ip)
{
	__u32 pass[4];

	__builtin_memcpy(pass, p->passthrough6, 16);
	return ip[0] == pass[0] && ip[1] == pass[1] && ip[2] == pass[2] && ip[3] == pass[3];
}

/* Whether a socket with this mark is delivered in the pod whatever its destination: the intent's
 * policy route (fwmark route_mark/route_mask, local default dev lo) takes it over lo. */
static __always_inline int routed_to_lo(const struct pod_policy *p, __u32 mark)
{
	return p->route_mask && (mark & p->route_mask) == p->route_mark;
}

static __always_inline int is_v6_unspecified(const __u32 *ip)
{
	return ip[0] == 0 && ip[1] == 0 && ip[2] == 0 && ip[3] == 0; /* :: (a socket with no source yet) */
}

/* ::ffff:a.b.c.d: an IPv4 peer of a dual-stack IPv6 socket. On the wire (and to
 * netfilter) that connection is IPv4, so it is keyed, matched and answered as
 * IPv4 everywhere. */
static __always_inline int is_v4_mapped(const __u32 *ip)
{
	return ip[0] == 0 && ip[1] == 0 && ip[2] == bpf_htonl(0xffff);
}

/* The key of a socket's end as the other end sees it: an IPv4-mapped address is
 * the IPv4 address (the app's AF_INET socket and a dual-stack proxy's accepted
 * socket then name the same connection alike). */
static __always_inline void tuple_addr(struct tuple_key *k, __u32 family, const __u32 *ip6, __u32 ip4)
{
	if (family == AF_INET6 && !is_v4_mapped(ip6)) {
		k->family = AF_INET6;
		__builtin_memcpy(k->addr, ip6, 16);
	} else {
		k->family = AF_INET;
		if (family == AF_INET6)
			ip4 = ip6[3];
		__builtin_memcpy(k->addr, &ip4, 4);
	}
}

/* A connection's key (struct pair_key) from one end's view: sockmap's `pairs` (redirect/bpf/sockmap.c),
 * local_conns (redirect/bpf/sockopt.c, sk_lookup.c). From a sock_ops or sk_msg context (the same field names): its own view (peer 0),
 * or its peer's (peer 1: local and remote swapped). remote_port holds the port in network order
 * in its upper 16 bits on little-endian machines (both context types), local_port in host order. */
static __always_inline void pair_addr(__u8 *dst, __u32 family, const __u32 *ip6, __u32 ip4)
{
	if (family == AF_INET6 && !is_v4_mapped(ip6)) {
		__builtin_memcpy(dst, ip6, 16);
	} else {
		if (family == AF_INET6)
			ip4 = ip6[3];
		__builtin_memcpy(dst, &ip4, 4);
	}
}

static __always_inline void pair_key_of(struct pair_key *k, __u64 netns, __u32 family, const __u32 *l6, __u32 l4,
					const __u32 *r6, __u32 r4, __u16 lport_be, __u16 rport_be, int peer)
{
	k->netns = netns;
	k->family = family == AF_INET6 && !is_v4_mapped(l6) ? AF_INET6 : AF_INET;
	if (peer) {
		pair_addr(k->laddr, family, r6, r4);
		pair_addr(k->raddr, family, l6, l4);
		k->lport_be = rport_be;
		k->rport_be = lport_be;
	} else {
		pair_addr(k->laddr, family, l6, l4);
		pair_addr(k->raddr, family, r6, r4);
		k->lport_be = lport_be;
		k->rport_be = rport_be;
	}
}

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define PAIR_RPORT(c) ((__u16)((c)->remote_port >> 16))
#else
#define PAIR_RPORT(c) ((__u16)(c)->remote_port)
#endif

#define PAIR_KEY(k, c, netns, peer)                                                                       \
	do {                                                                                              \
		__u32 l6_[4] = {(c)->local_ip6[0], (c)->local_ip6[1], (c)->local_ip6[2], (c)->local_ip6[3]}; \
		__u32 r6_[4] = {(c)->remote_ip6[0], (c)->remote_ip6[1], (c)->remote_ip6[2],                \
				(c)->remote_ip6[3]};                                                       \
		pair_key_of((k), (netns), (c)->family, l6_, (c)->local_ip4, r6_, (c)->remote_ip4,          \
			    bpf_htons((__u16)(c)->local_port), PAIR_RPORT(c), (peer));                     \
	} while (0)

/* Whether addr (16 bytes, IPv4 in the first 4) is loopback or one of the pod p's own addresses: its
 * RDR_CIDR_LOCAL* entries under keys (::6 among them) and the IPv6 link-local address its policy
 * holds (ll6). A link-local one is the pod's on whichever of its interfaces: no program here sees
 * the scope id a connect names the interface by. */
static __always_inline int own_address(const struct pod_policy *p, __u64 keys, const __u8 *addr, int v6)
{
	__u32 ip[4], ll[4];

	__builtin_memcpy(ip, addr, 16);
	if (v6 ? is_v6_loopback(ip) : is_v4_loopback(ip[0]))
		return 1;
	if (v6) {
		__builtin_memcpy(ll, p->ll6, 16);
		if (ll[0] && ip[0] == ll[0] && ip[1] == ll[1] && ip[2] == ll[2] && ip[3] == ll[3])
			return 1;
	}
	return cidr_listed(keys, v6 ? RDR_CIDR_LOCAL6 : RDR_CIDR_LOCAL4, addr, v6);
}

/* Whether Istio's INBOUND chain's port rules take an inbound TCP connection to port ... */
static __always_inline int inbound_listed(const struct pod_policy *p, __u64 keys, __u16 port)
{
	if (!(p->flags & RDR_F_INBOUND) || port == p->tunnel_port)
		return 0;
	if (p->flags & RDR_F_INBOUND_ALL)
		return !port_listed(keys, RDR_PORT_IN_EXCLUDE, port);
	return port_listed(keys, RDR_PORT_IN_INCLUDE, port);
}

/* ... to a port other than the inbound port itself (where the chain's REDIRECT or TPROXY changes
 * nothing: the connection reaches that port as it is). */
static __always_inline int inbound_captured(const struct pod_policy *p, __u64 keys, __u16 port)
{
	return port != p->inbound_port && inbound_listed(p, keys, port);
}

/* Whether Istio's inbound chain takes a new TCP connection to port: its port rules, which change
 * nothing for a local destination already at the inbound port (REDIRECT or TPROXY delivers it
 * there as it is), but do for one the pod forwards (fwd: its destination becomes the pod's). */
static __always_inline int inbound_taken(const struct pod_policy *p, __u64 keys, __u16 port, int fwd)
{
	return fwd ? inbound_listed(p, keys, port) : inbound_captured(p, keys, port);
}

/* Which of the proxy's listeners (RDR_LISTENER_*) new inbound TCP arriving on a reroute interface
 * goes to, or -1: not captured. Istio's nat PREROUTING sends it to the outbound port (only to
 * outbound_cidrs when not every destination is captured: out), except what TPROXY's mangle rules,
 * which run before nat's, take (the inbound port itself among them: delivered there as it is). */
static __always_inline int rerouted_listener(const struct pod_policy *p, __u64 keys, __u16 port, int out, int fwd)
{
	if ((p->flags & RDR_F_TPROXY) && inbound_listed(p, keys, port))
		return inbound_taken(p, keys, port, fwd) ? RDR_LISTENER_INBOUND : -1;
	return out ? RDR_LISTENER_OUTBOUND : -1;
}

#define RDR_PASS 0

/* Where a new outbound connection/datagram goes: RDR_PASS or the local port
 * to rewrite it to, by Istio's nat OUTPUT rules in their order over the
 * entries of the eBPF lowering (redirect/plan/lower_ebpf.py); outbound_target
 * below adds TPROXY's mangle ones. redirect/plan/evaluate.py models this
 * (evaluate_ebpf), and the property test tests/test_lowerings.py checks that
 * it lands every drawn connection where the netfilter lowering does. */
static __always_inline __u16 nat_target(const struct pod_policy *p, __u64 keys, int tcp, __u16 port,
					const __u8 *addr, int v6, int out_lo, int dst_is_lo_cidr, int src_passthrough)
{
	int dns53 = (p->flags & RDR_F_DNS) && port == p->resolver_port;
	int dns_listed;
	__u64 ug = bpf_get_current_uid_gid();
	int hairpin, lo_return, own;

	if (port_listed(keys, RDR_PORT_OUT_EXCLUDE, port))
		return RDR_PASS;
	if (out_lo && src_passthrough)
		return RDR_PASS;
	hairpin = tcp && !dst_is_lo_cidr;
	lo_return = (p->flags & RDR_F_LO_RETURN) &&
		    (!(p->flags & RDR_F_LO_RETURN_SPARES_DNS) || (tcp && port != p->resolver_port));
	own = owner_rules(keys, RDR_CIDR_UID, &p->uid0, p->n_uids, (__u32)ug, out_lo, hairpin, p->hairpin_uid_skip,
			  port, lo_return);
	if (own == RDR_OWN_NEXT)
		own = owner_rules(keys, RDR_CIDR_GID, &p->gid0, p->n_gids, (__u32)(ug >> 32), out_lo, hairpin,
				  p->hairpin_gid_skip, port, lo_return);
	if (own == RDR_OWN_INBOUND)
		return p->inbound_port;
	if (own == RDR_OWN_PASS)
		return RDR_PASS;
	/* Owner groups: iptables' --gid-owner without --suppl-groups, i.e. the primary gid. */
	if (p->groups_mode != RDR_GROUPS_ALL) {
		int in = id_listed(keys, RDR_CIDR_GROUP, &p->group0, p->n_groups, (__u32)(ug >> 32));

		if (in == (p->groups_mode == RDR_GROUPS_EXCLUDE))
			return RDR_PASS;
	}
	if (dns53) {
		dns_listed = (p->flags & RDR_F_DNS_ALL) ||
			     cidr_listed(keys, v6 ? RDR_CIDR_DNS6 : RDR_CIDR_DNS4, addr, v6);
		if (dns_listed)
			return p->dns_port; /* the proxy's own UDP queries returned above */
	}
	if (!tcp)
		return RDR_PASS; /* only DNS is captured for UDP */
	if (dst_is_lo_cidr)
		return RDR_PASS;
	if (cidr_listed(keys, v6 ? RDR_CIDR_OUT_EXCLUDE6 : RDR_CIDR_OUT_EXCLUDE4, addr, v6))
		return RDR_PASS;
	if (port_listed(keys, RDR_PORT_OUT_INCLUDE, port))
		return p->proxy_port;
	if (p->flags & RDR_F_OUT_ALL)
		return p->proxy_port;
	if (cidr_listed(keys, v6 ? RDR_CIDR_OUT_INCLUDE6 : RDR_CIDR_OUT_INCLUDE4, addr, v6))
		return p->proxy_port;
	return RDR_PASS;
}

/* Where a new outbound connection/datagram goes (the nat rules above), and in
 * TPROXY mode the mangle ones after them (redirect/plan/sidecar.py, "proxy uid to app over lo"
 * and the INBOUND chain): the proxy's TCP over lo to a non-loopback address
 * that nat left alone (its hairpin skips DNS and the tunnel port, an excluded
 * port returns, a uid past the first returns with the app's lo traffic) is
 * marked and meets inbound capture as it comes back in over lo; a socket
 * carrying the TPROXY mark (the proxy's connection to the app) is not. Here it
 * is rewritten to the inbound port at connect, as the hairpin is (its listener
 * then sees 127.0.0.1/::1 as the local address and reads the original
 * destination with SO_ORIGINAL_DST, where TPROXY leaves it as the local
 * address). */
static __always_inline __u16 outbound_target(const struct pod_policy *p, __u64 keys, int tcp, __u16 port,
					     const __u8 *addr, int v6, int out_lo, int dst_is_lo_cidr,
					     int src_passthrough, __u32 mark, __u32 bound_if)
{
	__u16 to;
	__u64 ug;

	if (leaves_excluded(p, keys, addr, v6, out_lo, bound_if))
		return RDR_PASS;
	to = nat_target(p, keys, tcp, port, addr, v6, out_lo, dst_is_lo_cidr, src_passthrough);

	if (to != RDR_PASS || !(p->flags & RDR_F_TPROXY) || !tcp || !out_lo || dst_is_lo_cidr || src_passthrough ||
	    mark == p->tproxy_mark)
		return to;
	ug = bpf_get_current_uid_gid();
	if (!id_listed(keys, RDR_CIDR_UID, &p->uid0, p->n_uids, (__u32)ug) &&
	    !id_listed(keys, RDR_CIDR_GID, &p->gid0, p->n_gids, (__u32)(ug >> 32)))
		return RDR_PASS;
	return inbound_captured(p, keys, port) ? p->inbound_port : RDR_PASS;
}

/* --- Ambient mode (RDR_F_AMBIENT): Istio's in-pod rules for a node proxy
 * (redirect/plan/ambient.py), over the entries of the eBPF lowering
 * (redirect/plan/lower_ebpf.py, lower_ambient). The node proxy is known by its sockets' mark,
 * not by owner; redirect/plan/evaluate.py models these as it does the above. */

/* Whether a socket's mark is the node proxy's (proxy_mark under mark_mask). */
static __always_inline int proxy_marked(const struct pod_policy *p, __u32 mark)
{
	return (mark & p->mark_mask) == p->proxy_mark;
}

/* Where a new outbound connection/datagram of an ambient pod goes: RDR_PASS or the local port
 * to rewrite it to, by the ambient plan's nat OUTPUT rules in their order. dst_is_lo_host: the
 * destination is the family's loopback host (127.0.0.1, ::1), which those rules leave alone. */
static __always_inline __u16 ambient_target(const struct pod_policy *p, __u64 keys, int tcp, __u16 port,
					    const __u8 *addr, int v6, int out_lo, int dst_is_lo_host, __u32 mark)
{
	int marked = proxy_marked(p, mark);

	/* Replies to kubelet probes (and so anything else to the probe address). */
	if (tcp && cidr_listed(keys, v6 ? RDR_CIDR_PROBE6 : RDR_CIDR_PROBE4, addr, v6))
		return RDR_PASS;
	/* DNS to the DNS proxy: UDP not over lo, TCP not to the loopback host; never the proxy's own. */
	if ((p->flags & RDR_F_DNS) && port == p->resolver_port && !marked && (tcp ? !dst_is_lo_host : !out_lo))
		return p->dns_port;
	/* A socket carrying the connection mark (the proxy's connections to the app, redirect/bpf/sockopt.c). */
	if (tcp && (mark & p->mark_mask) == p->conn_mark)
		return RDR_PASS;
	/* To the pod itself over lo. */
	if (!dst_is_lo_host && out_lo)
		return RDR_PASS;
	if (!dst_is_lo_host && tcp && !marked)
		return p->proxy_port;
	return RDR_PASS;
}

/* Which of the node proxy's listeners (RDR_LISTENER_*) a new inbound TCP connection to an
 * ambient pod from remote addr goes to, or -1: not captured. The ambient plan's nat PREROUTING
 * in its order: arriving on a reroute interface (rerouted), to the outbound port; else to the
 * inbound port, but not with bypass_inbound_capture, not to the tunnel port, not from the probe
 * address. The caller leaves out lo, the pod's own sources and connections made inside the pod
 * (local_conns). */
static __always_inline int ambient_listener(const struct pod_policy *p, __u64 keys, __u16 port, int v6,
					    const __u8 *addr, int rerouted)
{
	if (rerouted)
		return RDR_LISTENER_OUTBOUND;
	if (!(p->flags & RDR_F_INBOUND) || port == p->tunnel_port)
		return -1;
	if (cidr_listed(keys, v6 ? RDR_CIDR_PROBE6 : RDR_CIDR_PROBE4, addr, v6))
		return -1;
	return RDR_LISTENER_INBOUND;
}

/* Which of the proxy's listeners (RDR_LISTENER_*) a new inbound TCP connection goes to, or -1: not
 * captured; the one statement of inbound capture for both places that see such connections:
 * sk_lookup (redirect/bpf/sk_lookup.c: to one of the pod's own addresses) and the tc ingress program
 * (redirect/bpf/tc_forward.c: what the pod forwards, fwd). It arrived on ifindex from saddr to daddr:port
 * (16 bytes each, IPv4 in the first 4). Ambient: ambient_listener. Sidecar: Istio's PREROUTING in
 * its order: arriving on an excluded interface returns; on a reroute (kube-virt) interface,
 * rerouted_listener; else the inbound ports decide. The callers leave out lo, the pod's own
 * sources and connections made inside the pod. */
static __always_inline int pod_listener(const struct pod_policy *p, __u64 keys, __u16 port, __u32 ifindex, int v6,
					const __u8 *saddr, const __u8 *daddr, int fwd)
{
	int out;

	if (p->flags & RDR_F_AMBIENT)
		return ambient_listener(p, keys, port, v6, saddr, iface_rerouted(p, keys, ifindex));
	if (!(p->flags & (RDR_F_EXCL_IF | RDR_F_REROUTE_IF)))
		return inbound_taken(p, keys, port, fwd) ? RDR_LISTENER_INBOUND : -1;
	if (iface_excluded(p, keys, ifindex))
		return -1;
	if (!iface_rerouted(p, keys, ifindex))
		return inbound_taken(p, keys, port, fwd) ? RDR_LISTENER_INBOUND : -1;
	out = (p->flags & RDR_F_OUT_ALL) ||
	      cidr_listed(keys, v6 ? RDR_CIDR_OUT_INCLUDE6 : RDR_CIDR_OUT_INCLUDE4, daddr, v6);
	return rerouted_listener(p, keys, port, out, fwd);
}

#endif
