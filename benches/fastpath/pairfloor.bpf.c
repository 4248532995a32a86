/* pairfloor: the least a sockmap pairing can do, for the data-path benchmark's `pairing-floor`
 * case (benches/pairfloor.py): what the kernel charges a connection for having both of its ends
 * in a sockhash and every send moved to the peer's receive queue, with no capture and no program
 * logic around it. Not the product's pairing (redirect/bpf/sockmap.c): no pairing state, no
 * fallback to TCP, nothing the benchmark's plain request/response does not need.
 *
 * Every TCP connection to port PORT inside the netns of cookie NETNS: both ends join `ends` when
 * established (the connecting end at ACTIVE_ESTABLISHED_CB, the accepted one at
 * PASSIVE_ESTABLISHED_CB), keyed by (local port, remote port), which is unique among the live
 * connections to one port; each send of either end goes to the peer's ingress queue. `counts`
 * (per CPU): 0 ends joined, 1 sends redirected, 2 sends that found no peer (they go over TCP). */
#include <uapi/linux/bpf.h>

struct end_key {
	u32 lport, rport;
};

BPF_SOCKHASH(ends, struct end_key, 65536);
BPF_PERCPU_ARRAY(counts, u64, 3);

static __always_inline void count(int i)
{
	u64 *v = counts.lookup(&i);

	if (v)
		*v += 1;
}

int floor_ops(struct bpf_sock_ops *ctx)
{
	struct end_key k = {};
	u32 rport;
	long err;

	if (ctx->op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB && ctx->op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
		return 1;
	if (bpf_get_netns_cookie(ctx) != NETNS)
		return 1;
	rport = bpf_ntohs((u16)(ctx->remote_port >> 16)); /* (network order, in the upper half) */
	if (ctx->local_port != PORT && rport != PORT)
		return 1;
	k.lport = ctx->local_port;
	k.rport = rport;
	err = ends.sock_hash_update(ctx, &k, BPF_NOEXIST);
	if (!err)
		count(0);
	return 1;
}

int floor_msg(struct sk_msg_md *msg)
{
	struct end_key peer = {};
	long r;

	peer.lport = bpf_ntohs((u16)(msg->remote_port >> 16));
	peer.rport = msg->local_port;
	r = ends.msg_redirect_hash(msg, &peer, BPF_F_INGRESS);
	if (r == SK_PASS) {
		count(1);
		return SK_PASS;
	}
	count(2);
	return SK_PASS;
}
