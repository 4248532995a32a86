/* Inbound capture: an sk_lookup program linked to each pod's netns hands new
 * inbound TCP connections for captured ports to the proxy's inbound
 * listener. The accepted socket keeps the original destination as its local
 * address (like TPROXY, without marks or routes).
 *
 * The pod is the netns the packet is in, never "whoever has this address":
 * two pods may share an address (one gone without a teardown, or both alive
 * in separate networks). The netns cookie comes from the pod's own stub
 * program (see lookup_netns in redirect.h), whatever the destination.
 */
#include "policy.h"

#define LOOPBACK_IFINDEX 1 /* lo is ifindex 1 in every netns */

/* The pod to itself (the app to its own address, the proxy to the app) is
 * not captured, like iptables' PREROUTING never saw it. ingress_ifindex does
 * not say lo for these (the route to a local address keeps the address's
 * device as the input interface), so look at the source: loopback, or one of
 * this pod's own addresses (own_address: ::6 and its link-local ones included). */
static __always_inline int from_this_pod(struct bpf_sk_lookup *ctx, const struct pod_policy *p, __u64 keys)
{
	__u8 addr[16] = {};

	/* (Each family's fields read in its own branch, with one call per branch: see listener_for.) */
	if (ctx->family == AF_INET) {
		__u32 ip = ctx->remote_ip4;

		__builtin_memcpy(addr, &ip, 4);
		return own_address(p, keys, addr, 0);
	} else {
		__u32 ip[4] = {ctx->remote_ip6[0], ctx->remote_ip6[1], ctx->remote_ip6[2], ctx->remote_ip6[3]};

		__builtin_memcpy(addr, ip, 16);
		return own_address(p, keys, addr, 1);
	}
}

/* Which of the proxy's listeners the connection goes to (pod_listener, redirect/bpf/policy.h), or -1. */
static __always_inline int listener_for(struct bpf_sk_lookup *ctx, const struct pod_policy *p, __u64 keys)
{
	__u8 saddr[16] = {}, daddr[16] = {};

	/* Each family's fields read in its own branch, with one call per branch: merged, clang would
	 * load both families' fields through one modified ctx pointer, which the verifier refuses. */
	if (ctx->family == AF_INET) {
		__u32 rip = ctx->remote_ip4, lip = ctx->local_ip4;

		__builtin_memcpy(saddr, &rip, 4);
		__builtin_memcpy(daddr, &lip, 4);
		return pod_listener(p, keys, (__u16)ctx->local_port, ctx->ingress_ifindex, 0, saddr, daddr, 0);
	} else {
		__u32 rip[4] = {ctx->remote_ip6[0], ctx->remote_ip6[1], ctx->remote_ip6[2], ctx->remote_ip6[3]};
		__u32 lip[4] = {ctx->local_ip6[0], ctx->local_ip6[1], ctx->local_ip6[2], ctx->local_ip6[3]};

		__builtin_memcpy(saddr, rip, 16);
		__builtin_memcpy(daddr, lip, 16);
		return pod_listener(p, keys, (__u16)ctx->local_port, ctx->ingress_ifindex, 1, saddr, daddr, 0);
	}
}

/* Whether the connection was made inside the pod, from a source that is not the pod's (a proxy's
 * transparent connection to the app from the client's address): it is in local_conns, keyed by
 * both its ends as its connecting socket sees them (redirect/bpf/sockopt.c, local_connect).
 * Netfilter's nat PREROUTING never sees such a connection (TPROXY's mangle rules return it), so
 * it is never captured. Only that connection: another from the same client address and port (to
 * another of the pod's addresses or ports) comes from outside and is judged as any. */
static __always_inline int made_here(struct bpf_sk_lookup *ctx, __u64 netns)
{
	struct pair_key k = {};
	__u32 r6[4] = {}, l6[4] = {};

	/* (Each family's fields read in its own branch, as above.) */
	if (ctx->family == AF_INET) {
		pair_key_of(&k, netns, AF_INET, r6, ctx->remote_ip4, l6, ctx->local_ip4, (__u16)ctx->remote_port,
			    bpf_htons((__u16)ctx->local_port), 0);
	} else {
		r6[0] = ctx->remote_ip6[0];
		r6[1] = ctx->remote_ip6[1];
		r6[2] = ctx->remote_ip6[2];
		r6[3] = ctx->remote_ip6[3];
		l6[0] = ctx->local_ip6[0];
		l6[1] = ctx->local_ip6[1];
		l6[2] = ctx->local_ip6[2];
		l6[3] = ctx->local_ip6[3];
		pair_key_of(&k, netns, AF_INET6, r6, 0, l6, 0, (__u16)ctx->remote_port,
			    bpf_htons((__u16)ctx->local_port), 0);
	}
	return local_conns.lookup(&k) != NULL;
}

int rdr_sk_lookup(struct bpf_sk_lookup *ctx)
{
	struct listener_key lk = {};
	struct pod_policy *p;
	struct bpf_sock *sk;
	__u32 zero = 0;
	__u64 *slot, netns, keys;
	int err, kind;

	slot = lookup_netns.lookup(&zero);
	if (!slot)
		return SK_PASS;
	netns = *slot;
	*slot = 0;
	if (ctx->protocol != IPPROTO_TCP)
		return SK_PASS;
	/* Traffic over lo was generated in this pod (the app to itself, the
	 * proxy to the app): iptables' PREROUTING never captured it either. */
	if (ctx->ingress_ifindex == LOOPBACK_IFINDEX)
		return SK_PASS;
	p = pod_of(netns);
	if (!p || (ctx->family == AF_INET6 && !(p->flags & RDR_F_V6)))
		return SK_PASS;
	keys = pod_keys(p, netns);
	kind = listener_for(ctx, p, keys);
	if (kind < 0 || from_this_pod(ctx, p, keys) || made_here(ctx, netns))
		return SK_PASS;
	lk.netns = netns;
	lk.family = ctx->family;
	lk.kind = kind;
	sk = (struct bpf_sock *)listeners.lookup(&lk);
	if (!sk && ctx->family == AF_INET) {
		/* A dual-stack [::] listener serves IPv4 too. */
		lk.family = AF_INET6;
		sk = (struct bpf_sock *)listeners.lookup(&lk);
	}
	/* Fail closed: a captured port is never served around the proxy (that
	 * would skip its policy, e.g. mTLS). With no listener yet (the proxy not
	 * started) the SYN is dropped and the client retries; iptables would
	 * answer with a reset from the unused port. */
	if (!sk)
		return SK_DROP;
	err = bpf_sk_assign(ctx, sk, 0);
	bpf_sk_release(sk);
	return err ? SK_DROP : SK_PASS;
}
