/* Answering SO_ORIGINAL_DST without conntrack.
 *
 * The proxy's accepted socket is not the app's socket: its peer is the
 * app's socket's local address (<pod address>:<ephemeral>, as connect4 bound
 * it; or loopback). That port is only
 * chosen inside connect(), after connect4 ran, so connect4 keys the original
 * destination by the app socket's cookie, and sock_ops, called at
 * TCP_CONNECT_CB (port and source known, SYN not yet sent), moves it to a
 * key of (netns, family, local addr, local port). The getsockopt program on
 * the proxy side builds the same key from its socket's peer. An entry lives
 * as long as the connection, as conntrack's does: once the proxy's side is
 * established (PASSIVE_ESTABLISHED_CB: the app's socket, whose handshake just
 * completed, is still there) that side owns it and its close removes it, so
 * a client that sends and closes before the proxy accepts leaves the proxy
 * its original destination; the app's socket's close removes it only when
 * no proxy side took it (a refused connection). Both maps are LRU.
 */
#include "policy.h"

#define SO_ORIGINAL_DST 80 /* SOL_IP; IP6T_SO_ORIGINAL_DST is 80 on SOL_IPV6 */
#ifndef SOL_IP
#define SOL_IP 0
#endif
#ifndef SOL_IPV6
#define SOL_IPV6 41
#endif
#ifndef SOL_SOCKET
#define SOL_SOCKET 1
#endif
#ifndef SO_MARK
#define SO_MARK 36
#endif

static __always_inline void tuple_of_local(struct bpf_sock_ops *ctx, struct tuple_key *k, __u64 netns)
{
	__u32 ip[4] = {ctx->local_ip6[0], ctx->local_ip6[1], ctx->local_ip6[2], ctx->local_ip6[3]};

	k->netns = netns;
	k->port_be = bpf_htons((__u16)ctx->local_port);
	tuple_addr(k, ctx->family, ip, ctx->local_ip4);
}

/* The key of the socket's peer: for the proxy's side of a connection, the app's end. */
static __always_inline void tuple_of_remote(struct bpf_sock_ops *ctx, struct tuple_key *k, __u64 netns)
{
	__u32 ip[4] = {ctx->remote_ip6[0], ctx->remote_ip6[1], ctx->remote_ip6[2], ctx->remote_ip6[3]};

	k->netns = netns;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	k->port_be = (__u16)(ctx->remote_port >> 16); /* sock_ops: network order, in the upper half */
#else
	k->port_be = (__u16)ctx->remote_port;
#endif
	tuple_addr(k, ctx->family, ip, ctx->remote_ip4);
}

/* The proxy's inbound listener (and with reroute_interfaces its outbound one),
 * as it starts listening: sk_lookup hands it new inbound connections from
 * the `listeners` sockhash. Setup also adds the listeners that were already
 * open; the kernel drops an entry when its socket closes, and a restarted
 * proxy lands here again. */
static __always_inline void register_listener(struct bpf_sock_ops *ctx)
{
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct pod_policy *p = pod_of(netns);
	struct listener_key lk = {};

	if (!p)
		return;
	if ((p->flags & RDR_F_INBOUND) && ctx->local_port == p->inbound_port)
		lk.kind = RDR_LISTENER_INBOUND;
	else if ((p->flags & RDR_F_REROUTE_IF) && ctx->local_port == p->proxy_port)
		lk.kind = RDR_LISTENER_OUTBOUND;
	else
		return;
	lk.netns = netns;
	lk.family = ctx->family;
	listeners.sock_hash_update(ctx, &lk, BPF_ANY);
}

/* Whether a connection end (a tuple_key of it) is the pod's own (own_address, redirect/bpf/policy.h). */
static __always_inline int local_end(const struct tuple_key *k, const struct pod_policy *p, __u64 keys)
{
	return own_address(p, keys, k->addr, k->family == AF_INET6);
}

/* A TCP connection made in the pod to the pod itself (not one we sent to the proxy). With sockmap
 * on, the proxy's is paired (redirect/bpf/sockmap.c). From a source that is not the pod's: a
 * proxy's transparent connection to the app from the original client's address (ambient's node
 * proxy; a sidecar's with TPROXY, Envoy's original_src).
 *
 * sk_lookup would take it for inbound from that client: the connection (both ends: the client's
 * address and port, the pod's address and port) goes into local_conns (until the socket closes),
 * which sk_lookup passes, as netfilter's nat PREROUTING never sees locally generated connections
 * (and TPROXY's mangle rules return them: marked, or from lo unmarked). Both ends, not the client
 * end alone: a new connection from outside from the same client address and port to another of
 * the pod's addresses or ports is not this one, and is captured as iptables captures it.
 *
 * The app's replies are addressed to the client and would be routed out of the pod. Netfilter
 * saves the proxy's mark as a connmark and restores it on the replies, which the plan's policy
 * route (fwmark -> a table with local default dev lo) delivers back to the proxy. Here the
 * connection itself carries the route's mark: the pod runs with net.ipv4.tcp_fwmark_accept=1 (set
 * up by the backend), so the app's request socket takes the SYN's mark: the SYN-ACK, which leaves
 * before any callback of the app's side could mark a socket, already carries it, as does the
 * accepted socket, and every packet of the app's side takes the same policy route back to the
 * proxy. No per-packet program and no conntrack. A sidecar proxy's socket carries the route's
 * mark itself (tproxy_mark, as netfilter requires of it). Ambient's node proxy marks its sockets
 * proxy_mark, the route's is conn_mark: its socket gets conn_mark in place of proxy_mark under
 * mark_mask (bpf_setsockopt resets its cached route, and the SYN, sent after this callback, is
 * routed again), only with inbound capture (with bypass_inbound_capture the ambient plan sets no
 * connmark either). The socket keeps conn_mark for its life (restoring proxy_mark after the
 * handshake would break a connection whose app socket is made from a SYN cookie, which takes the
 * mark of the handshake's last ACK). */
static __always_inline void local_connect(struct bpf_sock_ops *ctx)
{
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct pod_policy *p = pod_of(netns);
	struct tuple_key here = {}, there = {};
	struct pair_key conn = {};
	struct bpf_sock *sk;
	__u32 ip[4], mark;
	__u64 keys;
	__u8 one = 1;

	if (!p)
		return;
	tuple_of_local(ctx, &here, netns);
	ip[0] = ctx->remote_ip6[0];
	ip[1] = ctx->remote_ip6[1];
	ip[2] = ctx->remote_ip6[2];
	ip[3] = ctx->remote_ip6[3];
	there.netns = netns;
	tuple_addr(&there, ctx->family, ip, ctx->remote_ip4);
	keys = pod_keys(p, netns);
	if (!local_end(&there, p, keys))
		return;
	if (local_end(&here, p, keys)) {
		/* An ordinary connection inside the pod: the proxy's to the app is paired (sockmap). */
		if ((p->flags & RDR_F_SOCKMAP) && pair_proxy_owned(ctx, p, keys))
			pair_candidate(ctx, netns);
		return;
	}
	PAIR_KEY(&conn, ctx, netns, 0);
	local_conns.update(&conn, &one);
	bpf_sock_ops_cb_flags_set(ctx, ctx->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
	if (p->flags & RDR_F_SOCKMAP)
		pair_candidate(ctx, netns);
	sk = ctx->sk;
	if (!sk || !(p->flags & RDR_F_AMBIENT) || !(p->flags & RDR_F_INBOUND))
		return;
	mark = sk->mark;
	if (!proxy_marked(p, mark))
		return;
	mark = (mark & ~p->mark_mask) | p->conn_mark;
	bpf_setsockopt(ctx, SOL_SOCKET, SO_MARK, &mark, sizeof(mark));
}

int rdr_sockops(struct bpf_sock_ops *ctx)
{
	struct tuple_key k = {}, r = {};
	struct pair_key pk = {};
	struct pod_policy *p;
	struct orig_dst *o;
	__u64 cookie;

	if (ctx->family != AF_INET && ctx->family != AF_INET6)
		return 1;
	if (ctx->op == BPF_SOCK_OPS_TCP_CONNECT_CB) {
		cookie = bpf_get_socket_cookie(ctx);
		o = orig_by_cookie.lookup(&cookie);
		if (!o) {
			local_connect(ctx); /* not a socket we redirected */
			return 1;
		}
		tuple_of_local(ctx, &k, o->netns);
		orig_by_tuple.update(&k, o);
		orig_by_cookie.delete(&cookie);
		/* Ask for state changes so the entry goes when the socket closes;
		 * keep whatever flags another program set. */
		bpf_sock_ops_cb_flags_set(ctx, ctx->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
		if (o->flags & RDR_ORIG_PAIR)
			pair_candidate(ctx, o->netns);
	} else if (ctx->op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB) {
		pair_active(ctx);
	} else if (ctx->op == BPF_SOCK_OPS_RTT_CB) {
		pair_rtt(ctx);
	} else if (ctx->op == BPF_SOCK_OPS_TCP_LISTEN_CB) {
		register_listener(ctx);
	} else if (ctx->op == BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB) {
		/* The proxy's side of a connection we redirected takes its entry over. */
		cookie = bpf_get_netns_cookie(ctx);
		tuple_of_remote(ctx, &k, cookie);
		o = orig_by_tuple.lookup(&k);
		if (!o) {
			p = pod_of(cookie);
			if (p && (p->flags & RDR_F_SOCKMAP))
				pair_passive(ctx, cookie); /* the app's end of the proxy's connection */
			return 1;
		}
		o->flags |= RDR_ORIG_ACCEPTED;
		bpf_sock_ops_cb_flags_set(ctx, ctx->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
		if (o->flags & RDR_ORIG_PAIR)
			pair_passive(ctx, cookie);
	} else if (ctx->op == BPF_SOCK_OPS_STATE_CB && ctx->args[1] == BPF_TCP_CLOSE) {
		/* Only sockets we flagged above get here (the netns is ours), each for one reason; the
		 * first lookup that finds its entry says which, and the others would find nothing (a
		 * lookup that misses still costs a cache miss on a random bucket). A pairing candidate
		 * (sockmap.c) first deletes its pairing state; the proxy's connection to one of the
		 * pod's own addresses was flagged for that alone, and misses every lookup below. The
		 * app's side: */
		cookie = bpf_get_netns_cookie(ctx);
		if (ctx->bpf_sock_ops_cb_flags & BPF_SOCK_OPS_RTT_CB_FLAG)
			pair_close(ctx, cookie);
		tuple_of_local(ctx, &k, cookie);
		o = orig_by_tuple.lookup(&k);
		if (o) {
			if (!(o->flags & RDR_ORIG_ACCEPTED))
				orig_by_tuple.delete(&k);
			return 1;
		}
		/* The proxy's side: */
		tuple_of_remote(ctx, &r, cookie);
		o = orig_by_tuple.lookup(&r);
		if (o && (o->flags & RDR_ORIG_ACCEPTED)) {
			orig_by_tuple.delete(&r);
			return 1;
		}
		/* A transparent connection (or the app's side after the proxy's took its entry away). A
		 * delete takes the bucket's lock even when there is nothing: looked up first. */
		PAIR_KEY(&pk, ctx, cookie, 0);
		if (local_conns.lookup(&pk))
			local_conns.delete(&pk);
	}
	return 1;
}

/* The verifier only accepts ctx field stores at a constant offset from the
 * unmodified ctx pointer; clang likes to merge the two stores of both
 * answer paths into "ctx += off; *ctx = ...". The empty asm pins ctx. */
static __always_inline void set_result(struct bpf_sockopt *ctx, __s32 optlen)
{
	asm volatile("" : "+r"(ctx));
	ctx->optlen = optlen;
	asm volatile("" : "+r"(ctx));
	ctx->retval = 0;
}

static __always_inline int answer4(struct bpf_sockopt *ctx, const __u8 *addr, __u16 port_be)
{
	struct sockaddr_in *sin = ctx->optval;

	if ((void *)(sin + 1) > ctx->optval_end)
		return 1;
	sin->sin_family = AF_INET;
	sin->sin_port = port_be;
	__builtin_memcpy(&sin->sin_addr.s_addr, addr, 4);
	__builtin_memset(sin->sin_zero, 0, sizeof(sin->sin_zero));
	set_result(ctx, sizeof(*sin));
	return 1;
}

static __always_inline int answer6(struct bpf_sockopt *ctx, const __u8 *addr, __u16 port_be)
{
	struct sockaddr_in6 *sin6 = ctx->optval;

	if ((void *)(sin6 + 1) > ctx->optval_end)
		return 1;
	sin6->sin6_family = AF_INET6;
	sin6->sin6_port = port_be;
	sin6->sin6_flowinfo = 0;
	__builtin_memcpy(&sin6->sin6_addr, addr, 16);
	sin6->sin6_scope_id = 0;
	set_result(ctx, sizeof(*sin6));
	return 1;
}

/* What netfilter answers, level by level: conntrack is asked for the socket's
 * tuple in the level's family, so SOL_IP answers for IPv4 connections (an
 * AF_INET socket, or an IPv4 peer of a dual-stack one: ::ffff:a.b.c.d) and
 * SOL_IPV6 for native IPv6 ones; the other level is ENOENT, left to the kernel. */
int rdr_getsockopt(struct bpf_sockopt *ctx)
{
	struct tuple_key k = {};
	struct pod_policy *p;
	struct orig_dst *o;
	struct bpf_sock *sk = ctx->sk;
	__u32 dst6[4], src6[4], src4;
	__u64 netns;
	int v6;

	/* Everything but SO_ORIGINAL_DST passes untouched, before any lookup. */
	if (ctx->optname != SO_ORIGINAL_DST || (ctx->level != SOL_IP && ctx->level != SOL_IPV6))
		return 1;
	if (!sk)
		return 1;
	netns = bpf_get_netns_cookie(ctx);
	p = pod_of(netns);
	if (!p)
		return 1;
	if (sk->family != AF_INET && sk->family != AF_INET6)
		return 1;
	dst6[0] = sk->dst_ip6[0];
	dst6[1] = sk->dst_ip6[1];
	dst6[2] = sk->dst_ip6[2];
	dst6[3] = sk->dst_ip6[3];
	k.netns = netns;
	k.port_be = (__u16)sk->dst_port;
	tuple_addr(&k, sk->family, dst6, sk->dst_ip4);
	v6 = ctx->level == SOL_IPV6;
	if (k.family != (v6 ? AF_INET6 : AF_INET))
		return 1; /* the other level's connection: netfilter has no answer either */
	o = orig_by_tuple.lookup(&k);
	if (o)
		return v6 ? answer6(ctx, o->addr, o->port_be) : answer4(ctx, o->addr, o->port_be);
	/* Inbound, steered by sk_lookup: the socket's own local address is the
	 * original destination (what conntrack would answer without NAT). Never
	 * for the proxy's outbound port: a missing entry there must stay an
	 * error, not a loop back into the proxy. */
	if (ctx->retval == 0 || sk->src_port == p->proxy_port)
		return 1;
	if (v6) {
		src6[0] = sk->src_ip6[0];
		src6[1] = sk->src_ip6[1];
		src6[2] = sk->src_ip6[2];
		src6[3] = sk->src_ip6[3];
		return answer6(ctx, (const __u8 *)src6, bpf_htons((__u16)sk->src_port));
	}
	src4 = sk->src_ip4; /* an IPv4-mapped socket has its IPv4 address there too */
	return answer4(ctx, (const __u8 *)&src4, bpf_htons((__u16)sk->src_port));
}
