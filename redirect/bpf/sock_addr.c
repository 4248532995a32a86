/* cgroup sock_addr programs: outbound capture (connect4/6) and UDP DNS
 * (connect4/6 for connected sockets, sendmsg4/6 + recvmsg4/6 otherwise).
 *
 * Attached once at the cgroup v2 root, so they run for every socket on the
 * host: the first thing each does is look the socket's netns cookie up in
 * `pods`, and an unregistered namespace returns 1 (allow, untouched).
 */
#include "policy.h"

#define SYS_PROCEED 1

/* An IPv6 address copied to or from a sock_addr context's user_ip6 or msg_src_ip6, one 32-bit word
 * at a time: narrower or wider loads and stores of those fields are refused by the verifier. */
#define IP6_COPY(to, from)             \
	do {                           \
		(to)[0] = (from)[0];   \
		(to)[1] = (from)[1];   \
		(to)[2] = (from)[2];   \
		(to)[3] = (from)[3];   \
	} while (0)

/* Rewriting the destination of a locally generated connection to loopback
 * is what REDIRECT does in OUTPUT; the proxy listens on 127.0.0.1 / ::1
 * (or a wildcard). */
static __always_inline void remember(void *map_is_dns, __u64 key, __u64 netns, __u32 family, __u16 port_be,
				     const __u8 *addr, __u16 via, const struct pod_policy *p)
{
	struct orig_dst o = {.netns = netns, .family = family, .port_be = port_be, .via_port = via,
			     .flags = p->flags & RDR_F_SOCKMAP ? RDR_ORIG_PAIR : 0};

	__builtin_memcpy(o.addr, addr, 16);
	if (map_is_dns)
		dns_by_cookie.update(&key, &o);
	else
		orig_by_cookie.update(&key, &o);
}

/* outbound_target for an IPv4 destination (src: the socket's source, for the
 * passthrough address); *out_lo: whether it leaves over lo (to the pod's own address,
 * own_address, or by the plan's policy route for its mark, routed_to_lo), for source4. */
static __always_inline __u16 target4(const struct pod_policy *p, __u64 keys, int tcp, __u16 port, __u32 dst,
				     __u32 src, __u32 mark, __u32 bound_if, int *out_lo_p)
{
	__u8 addr[16] = {};
	int out_lo, dst_is_lo = (dst & p->lo4_mask) == p->lo4_addr;

	__builtin_memcpy(addr, &dst, 4);
	out_lo = own_address(p, keys, addr, 0) || routed_to_lo(p, mark);
	*out_lo_p = out_lo;
	if (p->flags & RDR_F_AMBIENT)
		return ambient_target(p, keys, tcp, port, addr, 0, out_lo, dst_is_lo, mark);
	return outbound_target(p, keys, tcp, port, addr, 0, out_lo, dst_is_lo, is_v4_passthrough(p, src), mark,
			       bound_if);
}

/* The source the connection would have had under iptables, whose nat OUTPUT runs after the
 * kernel picked it: a destination delivered in the pod (out_lo, as the target's decision found
 * it: the pod's own, or routed over lo by the socket's mark) is its own source (127/8 and ::1 answer from loopback, as the rewritten destination does too:
 * 0), anything else the pod's (src4, src6 of the policy, 0 when it has none). */
static __always_inline __u32 source4(const struct pod_policy *p, __u32 dst, int out_lo)
{
	__u32 src;

	if (is_v4_loopback(dst))
		return 0;
	if (out_lo)
		return dst;
	__builtin_memcpy(&src, p->src4, 4);
	return src;
}

static __always_inline const __u8 *source6(const struct pod_policy *p, const __u32 *dst, int out_lo)
{
	if (is_v6_loopback(dst))
		return NULL;
	if (out_lo)
		return (const __u8 *)dst;
	if (!(p->src6[0] | p->src6[1] | p->src6[2] | p->src6[3] | p->src6[4] | p->src6[5] | p->src6[6] |
	      p->src6[7] | p->src6[8] | p->src6[9] | p->src6[10] | p->src6[11] | p->src6[12] | p->src6[13] |
	      p->src6[14] | p->src6[15]))
		return NULL;
	return p->src6;
}

/* A socket without a source of its own that we send to the proxy gets that source (connect: bound
 * to it, port 0, which connect then picks; sendmsg: the datagram's), so the proxy sees the pod's
 * address as the peer and the app its own as the local end, as under iptables. A bind that fails
 * (the socket has a port already) leaves the kernel's choice. */
static __always_inline void give_source4(struct bpf_sock_addr *ctx, __u32 src, int from_sendmsg)
{
	struct sockaddr_in sa = {.sin_family = AF_INET};

	if (!src || ctx->sk->src_ip4)
		return;
	if (from_sendmsg) {
		if (!ctx->msg_src_ip4)
			ctx->msg_src_ip4 = src;
		return;
	}
	sa.sin_addr.s_addr = src;
	bpf_bind(ctx, (void *)&sa, sizeof(sa));
}

/* give_source4 for an IPv6 socket (src: 16 bytes, an IPv4-mapped one for an IPv4 destination). */
static __always_inline void give_source6(struct bpf_sock_addr *ctx, const __u8 *src, int from_sendmsg)
{
	struct sockaddr_in6 sa = {.sin6_family = AF_INET6};
	__u32 ip[4];

	if (!src || ctx->sk->src_ip6[0] || ctx->sk->src_ip6[1] || ctx->sk->src_ip6[2] || ctx->sk->src_ip6[3])
		return;
	__builtin_memcpy(ip, src, 16);
	if (from_sendmsg) {
		if (!(ctx->msg_src_ip6[0] | ctx->msg_src_ip6[1] | ctx->msg_src_ip6[2] | ctx->msg_src_ip6[3])) {
			IP6_COPY(ctx->msg_src_ip6, ip);
		}
		return;
	}
	__builtin_memcpy(&sa.sin6_addr, ip, 16);
	bpf_bind(ctx, (void *)&sa, sizeof(sa));
}

/* A socket of a registered pod, of a kind we redirect: TCP on connect, UDP
 * (DNS) on connect and sendmsg. *tcp says which. A datagram socket of another protocol
 * (UDP-Lite, ICMP's ping sockets) is not UDP to netfilter's -p udp either. */
static __always_inline int redirectable(struct bpf_sock_addr *ctx, const struct pod_policy *p, int from_sendmsg,
					int *tcp)
{
	if (!p)
		return 0;
	*tcp = ctx->type == SOCK_STREAM;
	if (!*tcp && (ctx->type != SOCK_DGRAM || ctx->protocol != IPPROTO_UDP))
		return 0;
	return !(from_sendmsg && *tcp);
}

static __always_inline int redirect4(struct bpf_sock_addr *ctx, int from_sendmsg)
{
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct pod_policy *p = pod_of(netns);
	__u8 addr[16] = {};
	__u32 dst = ctx->user_ip4;
	__u16 to;
	int tcp, out_lo;

	if (!redirectable(ctx, p, from_sendmsg, &tcp))
		return SYS_PROCEED;
	/* 0.0.0.0: the kernel connects (sends) to 127.0.0.1 over lo, which is what netfilter sees. */
	if (!dst)
		dst = bpf_htonl(0x7f000001);
	to = target4(p, pod_keys(p, netns), tcp, bpf_ntohs((__u16)ctx->user_port), dst,
		     from_sendmsg ? ctx->msg_src_ip4 : ctx->sk->src_ip4, ctx->sk->mark,
		     ctx->sk->bound_dev_if, &out_lo);
	if (to == RDR_PASS)
		return SYS_PROCEED;
	/* TCP: keyed by this socket's cookie until sock_ops learns its port.
	 * UDP: keyed by cookie for as long as the socket lives (recvmsg). */
	__builtin_memcpy(addr, &dst, 4);
	remember(tcp ? NULL : (void *)1, bpf_get_socket_cookie(ctx), netns, AF_INET, (__u16)ctx->user_port, addr, to, p);
	give_source4(ctx, source4(p, dst, out_lo), from_sendmsg);
	ctx->user_ip4 = bpf_htonl(0x7f000001);
	ctx->user_port = bpf_htons(to);
	return SYS_PROCEED;
}

static __always_inline int redirect6(struct bpf_sock_addr *ctx, int from_sendmsg)
{
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct pod_policy *p = pod_of(netns);
	__u32 dst[4], src[4];
	__u8 addr[16] = {};
	__u16 port, to;
	__u64 keys;
	int tcp, out_lo;

	if (!redirectable(ctx, p, from_sendmsg, &tcp))
		return SYS_PROCEED;
	IP6_COPY(dst, ctx->user_ip6);
	if (from_sendmsg) {
		IP6_COPY(src, ctx->msg_src_ip6);
	} else {
		src[0] = ctx->sk->src_ip6[0];
		src[1] = ctx->sk->src_ip6[1];
		src[2] = ctx->sk->src_ip6[2];
		src[3] = ctx->sk->src_ip6[3];
	}
	port = bpf_ntohs((__u16)ctx->user_port);
	/* ::, ::ffff:0.0.0.0: the kernel connects (sends) to ::1, 127.0.0.1 over lo, which is what
	 * netfilter sees. */
	if (is_v6_unspecified(dst))
		dst[3] = bpf_htonl(1);
	else if (is_v4_mapped(dst) && !dst[3])
		dst[3] = bpf_htonl(0x7f000001);
	if (is_v4_mapped(dst)) {
		/* An IPv4 destination through a dual-stack socket: IPv4 on the wire,
		 * so IPv4's rules (whatever the pod's IPv6), recorded as IPv4, sent
		 * to the IPv4 loopback. */
		to = target4(p, pod_keys(p, netns), tcp, port, dst[3], is_v4_mapped(src) ? src[3] : 0, ctx->sk->mark,
			     ctx->sk->bound_dev_if, &out_lo);
		if (to == RDR_PASS)
			return SYS_PROCEED;
		__builtin_memcpy(addr, &dst[3], 4);
		remember(tcp ? NULL : (void *)1, bpf_get_socket_cookie(ctx), netns, AF_INET, (__u16)ctx->user_port,
			 addr, to, p);
		if (!from_sendmsg) { /* (a datagram's source is given in the IPv4 hook's terms: left alone) */
			src[0] = 0;
			src[1] = 0;
			src[2] = bpf_htonl(0xffff);
			src[3] = source4(p, dst[3], out_lo);
			give_source6(ctx, src[3] ? (const __u8 *)src : NULL, 0);
		}
		ctx->user_ip6[0] = 0;
		ctx->user_ip6[1] = 0;
		ctx->user_ip6[2] = bpf_htonl(0xffff);
		ctx->user_ip6[3] = bpf_htonl(0x7f000001);
		ctx->user_port = bpf_htons(to);
		return SYS_PROCEED;
	}
	if (!(p->flags & RDR_F_V6))
		return SYS_PROCEED;
	keys = pod_keys(p, netns);
	out_lo = own_address(p, keys, (const __u8 *)dst, 1) || routed_to_lo(p, ctx->sk->mark);
	/* No source yet and ::6 as the destination: the kernel picks ::6 itself as the source (the
	 * destination is a local address), so netfilter sees the inbound passthrough. */
	if (p->flags & RDR_F_AMBIENT)
		to = ambient_target(p, keys, tcp, port, (const __u8 *)dst, 1, out_lo, is_v6_loopback(dst),
				    ctx->sk->mark);
	else
		to = outbound_target(p, keys, tcp, port, (const __u8 *)dst, 1, out_lo, is_v6_loopback(dst),
				     is_v6_passthrough(p, src) ||
					     (is_v6_unspecified(src) && is_v6_passthrough(p, dst)),
				     ctx->sk->mark, ctx->sk->bound_dev_if);
	if (to == RDR_PASS)
		return SYS_PROCEED;
	remember(tcp ? NULL : (void *)1, bpf_get_socket_cookie(ctx), netns, AF_INET6, (__u16)ctx->user_port,
		 (const __u8 *)dst, to, p);
	give_source6(ctx, source6(p, dst, out_lo), from_sendmsg);
	ctx->user_ip6[0] = 0;
	ctx->user_ip6[1] = 0;
	ctx->user_ip6[2] = 0;
	ctx->user_ip6[3] = bpf_htonl(1);
	ctx->user_port = bpf_htons(to);
	return SYS_PROCEED;
}

int rdr_connect4(struct bpf_sock_addr *ctx)
{
	return redirect4(ctx, 0);
}

int rdr_connect6(struct bpf_sock_addr *ctx)
{
	return redirect6(ctx, 0);
}

int rdr_sendmsg4(struct bpf_sock_addr *ctx)
{
	return redirect4(ctx, 1);
}

int rdr_sendmsg6(struct bpf_sock_addr *ctx)
{
	return redirect6(ctx, 1);
}

/* A DNS answer comes from the DNS proxy on loopback; the app must see it come
 * from the server it asked (resolvers drop answers from anyone else). Only
 * sockets we redirected have an entry, so this is a no-op for the rest. */
int rdr_recvmsg4(struct bpf_sock_addr *ctx)
{
	__u64 cookie = bpf_get_socket_cookie(ctx);
	struct orig_dst *o = dns_by_cookie.lookup(&cookie);
	__u32 ip;

	if (!o || o->family != AF_INET || !pod_of(o->netns))
		return SYS_PROCEED;
	if (ctx->user_ip4 != bpf_htonl(0x7f000001) || bpf_ntohs((__u16)ctx->user_port) != o->via_port)
		return SYS_PROCEED;
	__builtin_memcpy(&ip, o->addr, 4);
	ctx->user_ip4 = ip;
	ctx->user_port = o->port_be;
	return SYS_PROCEED;
}

/* Where we sent an IPv6 socket's connection or datagram: ::1, or
 * ::ffff:127.0.0.1 for an IPv4 destination (recorded as AF_INET). */
static __always_inline int sent_to_us6(const struct orig_dst *o, __u32 ip0, __u32 ip1, __u32 ip2, __u32 ip3)
{
	if (ip0 || ip1)
		return 0;
	if (o->family == AF_INET)
		return ip2 == bpf_htonl(0xffff) && ip3 == bpf_htonl(0x7f000001);
	return o->family == AF_INET6 && !ip2 && ip3 == bpf_htonl(1);
}

/* The answer of an IPv6 socket says the original destination (an IPv4 one mapped). */
static __always_inline int restore6(struct bpf_sock_addr *ctx, const struct orig_dst *o)
{
	__u32 ip[4];

	if (o->family == AF_INET) {
		ip[0] = 0;
		ip[1] = 0;
		ip[2] = bpf_htonl(0xffff);
		__builtin_memcpy(&ip[3], o->addr, 4);
	} else {
		__builtin_memcpy(ip, o->addr, 16);
	}
	IP6_COPY(ctx->user_ip6, ip);
	ctx->user_port = o->port_be;
	return SYS_PROCEED;
}

int rdr_recvmsg6(struct bpf_sock_addr *ctx)
{
	__u64 cookie = bpf_get_socket_cookie(ctx);
	struct orig_dst *o = dns_by_cookie.lookup(&cookie);

	if (!o || !pod_of(o->netns))
		return SYS_PROCEED;
	if (!sent_to_us6(o, ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]) ||
	    bpf_ntohs((__u16)ctx->user_port) != o->via_port)
		return SYS_PROCEED;
	return restore6(ctx, o);
}

/* Per-socket state (the original destination staged by connect, a DNS
 * socket's server) goes with the socket, so teardown never has to walk these
 * maps. A no-op for sockets without an entry. */
int rdr_sock_release(struct bpf_sock *ctx)
{
	__u64 cookie = bpf_get_socket_cookie(ctx);

	/* A TCP socket's entry is in orig_by_cookie, a UDP one's in dns_by_cookie (remember); looked
	 * up first: a delete takes the bucket's lock even for a key that is not there, and nearly
	 * every socket on the host has none. */
	if (ctx->type == SOCK_STREAM) {
		if (orig_by_cookie.lookup(&cookie))
			orig_by_cookie.delete(&cookie);
	} else if (dns_by_cookie.lookup(&cookie)) {
		dns_by_cookie.delete(&cookie);
	}
	return 1;
}

/* getpeername on a socket we redirected: the app sees the peer it connected
 * to, as it does through iptables' NAT (which rewrites packets, not
 * sockets). TCP: by the socket's local end (orig_by_tuple, see sockopt.c);
 * connected UDP (DNS): by socket cookie. Only an answer that still names
 * where we sent it is rewritten. */
int rdr_getpeername4(struct bpf_sock_addr *ctx)
{
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct orig_dst *o;
	__u64 cookie;
	__u32 ip;

	if (!pod_of(netns) || ctx->user_ip4 != bpf_htonl(0x7f000001))
		return SYS_PROCEED;
	if (ctx->type == SOCK_STREAM) {
		struct tuple_key k = {.netns = netns, .family = AF_INET};

		k.port_be = bpf_htons((__u16)ctx->sk->src_port);
		ip = ctx->sk->src_ip4;
		__builtin_memcpy(k.addr, &ip, 4);
		o = orig_by_tuple.lookup(&k);
	} else {
		cookie = bpf_get_socket_cookie(ctx);
		o = dns_by_cookie.lookup(&cookie);
	}
	if (!o || o->family != AF_INET || bpf_ntohs((__u16)ctx->user_port) != o->via_port)
		return SYS_PROCEED;
	__builtin_memcpy(&ip, o->addr, 4);
	ctx->user_ip4 = ip;
	ctx->user_port = o->port_be;
	return SYS_PROCEED;
}

int rdr_getpeername6(struct bpf_sock_addr *ctx)
{
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct orig_dst *o;
	__u64 cookie;
	__u32 ip[4], u[4];

	if (!pod_of(netns))
		return SYS_PROCEED;
	IP6_COPY(u, ctx->user_ip6);
	if (u[0] || u[1] || !((!u[2] && u[3] == bpf_htonl(1)) || (u[2] == bpf_htonl(0xffff) && u[3] == bpf_htonl(0x7f000001))))
		return SYS_PROCEED;
	if (ctx->type == SOCK_STREAM) {
		struct tuple_key k = {.netns = netns};

		k.port_be = bpf_htons((__u16)ctx->sk->src_port);
		ip[0] = ctx->sk->src_ip6[0];
		ip[1] = ctx->sk->src_ip6[1];
		ip[2] = ctx->sk->src_ip6[2];
		ip[3] = ctx->sk->src_ip6[3];
		tuple_addr(&k, AF_INET6, ip, 0);
		o = orig_by_tuple.lookup(&k);
	} else {
		cookie = bpf_get_socket_cookie(ctx);
		o = dns_by_cookie.lookup(&cookie);
	}
	if (!o || !sent_to_us6(o, u[0], u[1], u[2], u[3]) || bpf_ntohs((__u16)ctx->user_port) != o->via_port)
		return SYS_PROCEED;
	return restore6(ctx, o);
}
