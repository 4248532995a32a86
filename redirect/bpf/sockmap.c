/* sockmap: the two ends of a pod's app <-> proxy connection, paired, so that each send is
 * moved to the peer's receive queue instead of going down one TCP/IP stack and up the other.
 *
 * Which connections (pods with RDR_F_SOCKMAP, decided at the connecting end's TCP_CONNECT_CB,
 * where the connecting task is current): the app's connection that connect4/6 sent to the proxy
 * (outbound: its orig_dst carries RDR_ORIG_PAIR), the proxy's transparent connection to the app
 * (local_conns), and a connection of the proxy's (its uid or gid; ambient: its mark) to one of
 * the pod's own addresses or loopback (inbound, passthrough, hairpin). Nothing else of the pod.
 *
 * The kernel's rules that shape this (docs/kernel-facts.md, "Sockmap"):
 * - the receiver reads redirected bytes before any in its TCP receive queue, so a direction that
 *   sent anything over TCP must never redirect after (rdr_sk_msg: pair_tcp);
 * - a paired socket that receives over TCP misreads (FIONREAD, a blocking read's EAGAIN), so a
 *   connection is either paired at both ends or at neither: the accepted end joins only while
 *   the connecting end's state is OPEN, and the connecting end, whose first send found no peer
 *   (it may write before the accepted end's PASSIVE_ESTABLISHED_CB ran), takes the state to TCP
 *   first: one compare-and-swap decides, and the loser stays out (or leaves);
 * - removing a socket from the map discards the bytes queued for it: a socket leaves only when
 *   nothing can have been redirected to it (the connecting end that won TCP: the accepted end
 *   never stayed in the map), or by closing. Teardown and unload leave paired connections alone;
 * - an LRU map's element serves another key as soon as it is deleted or evicted: the state word
 *   the two ends swap carries the connection's identity, and the entry goes when the connecting
 *   end closes (pair_close), so the table holds live connections and an insert need not evict.
 */
#include "policy.h"

/* pair_state.state of a connection whose connecting end's ISN + 1 is isn, in state s (RDR_PAIR_*),
 * and the state alone. */
#define PAIR_WORD(isn, s) (((__u64)(__u32)(isn) << 32) | (s))
#define PAIR_STATE_OF(w) ((w) & RDR_PAIR_STATE_MASK)

/* The proxy's own socket: its uid or gid (sidecar; the connecting task is current at
 * TCP_CONNECT_CB) or its mark (ambient's node proxy). */
static __always_inline int pair_proxy_owned(struct bpf_sock_ops *ctx, const struct pod_policy *p, __u64 keys)
{
	struct bpf_sock *sk = ctx->sk;
	__u64 ugid;

	if (p->flags & RDR_F_AMBIENT)
		return sk && proxy_marked(p, sk->mark);
	ugid = bpf_get_current_uid_gid();
	return id_listed(keys, RDR_CIDR_UID, &p->uid0, p->n_uids, (__u32)ugid) ||
	       id_listed(keys, RDR_CIDR_GID, &p->gid0, p->n_gids, (__u32)(ugid >> 32));
}

/* TCP_CONNECT_CB of a candidate (see the top): its state PENDING, RTT callbacks asked for (they
 * do something only once its sends went over TCP: then it leaves the map), and state changes (at
 * CLOSE its state goes: the table holds live connections alone, so a new entry never has to
 * evict one). */
static __always_inline void pair_candidate(struct bpf_sock_ops *ctx, __u64 netns)
{
	struct pair_key k = {};
	struct pair_state st = {.state = RDR_PAIR_PENDING};

	PAIR_KEY(&k, ctx, netns, 0);
	pair_state.update(&k, &st);
	bpf_sock_ops_cb_flags_set(ctx, ctx->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_RTT_CB_FLAG |
					       BPF_SOCK_OPS_STATE_CB_FLAG);
}

/* ACTIVE_ESTABLISHED_CB: a candidate joins (connect() has not returned yet: nothing was sent),
 * unless data went with the SYN (fast open). */
static __always_inline void pair_active(struct bpf_sock_ops *ctx)
{
	struct pair_key k = {};
	struct pair_state *st;
	__u32 isn;
	int err;

	if (!(ctx->bpf_sock_ops_cb_flags & BPF_SOCK_OPS_RTT_CB_FLAG))
		return; /* not a candidate (the flag is set for them alone, before any map look-up) */
	PAIR_KEY(&k, ctx, bpf_get_netns_cookie(ctx), 0);
	st = pair_state.lookup(&k);
	if (!st || st->state != RDR_PAIR_PENDING)
		return;
	isn = ctx->snd_nxt;
	if (ctx->data_segs_out || ctx->bytes_received) {
		st->state = PAIR_WORD(isn, RDR_PAIR_TCP);
		return;
	}
	st->isn_a = ctx->rcv_nxt;
	err = pairs.sock_hash_update(ctx, &k, BPF_NOEXIST);
	/* (atomic: isn_a is written before an accepted end can see OPEN) */
	__sync_val_compare_and_swap(&st->state, RDR_PAIR_PENDING, PAIR_WORD(isn, err ? RDR_PAIR_TCP : RDR_PAIR_OPEN));
}

/* PASSIVE_ESTABLISHED_CB: the accepted end joins if the connecting end is OPEN for this very
 * handshake (before accept(): nothing was sent yet). In first, then the state: a connecting end
 * that sees JOINED finds it in the map. */
static __always_inline void pair_passive(struct bpf_sock_ops *ctx, __u64 netns)
{
	struct pair_key k = {}, own = {};
	struct pair_state *st;
	__u64 open, was;
	int err;

	PAIR_KEY(&k, ctx, netns, 1);
	st = pair_state.lookup(&k);
	open = PAIR_WORD(ctx->rcv_nxt, RDR_PAIR_OPEN);
	if (!st || st->state != open || st->isn_a != ctx->snd_nxt)
		return;
	PAIR_KEY(&own, ctx, netns, 0);
	err = pairs.sock_hash_update(ctx, &own, BPF_NOEXIST);
	if (err)
		return; /* the connecting end finds no peer and goes over TCP */
	was = __sync_val_compare_and_swap(&st->state, open, PAIR_WORD(ctx->rcv_nxt, RDR_PAIR_JOINED));
	if (was == PAIR_WORD(ctx->rcv_nxt, RDR_PAIR_TCP) || was == PAIR_WORD(ctx->rcv_nxt, RDR_PAIR_LEFT))
		pairs.delete(&own); /* it sent over TCP meanwhile: out again, before accept() */
	/* Otherwise joined, or the entry is no longer this connection's: its connecting end closed
	 * (and may have sent here first: what it sent stays readable) or, with the table full of live
	 * connections, the entry was evicted, and the connecting end, in the map, finds this one. */
}

/* RTT_CB of a candidate: nothing until its sends went over TCP (pair_tcp: a socket-local look-up,
 * as every ACK that measures a round trip calls this, the handshake's and the close's). If it won
 * TCP (the accepted end never stayed in the map, so nothing was ever redirected to it), it
 * leaves the map and the connection is plain TCP at both ends. */
static __always_inline void pair_rtt(struct bpf_sock_ops *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	struct pair_key k = {};
	struct pair_state *st;

	if (!sk || !pair_tcp.sk_storage_get(sk, 0, 0))
		return; /* its sends did not go over TCP */
	PAIR_KEY(&k, ctx, bpf_get_netns_cookie(ctx), 0);
	st = pair_state.lookup(&k);
	if (!st || PAIR_STATE_OF(st->state) != RDR_PAIR_TCP)
		return;
	st->state = (st->state & ~(__u64)RDR_PAIR_STATE_MASK) | RDR_PAIR_LEFT;
	pairs.delete(&k);
}

/* STATE_CB to TCP_CLOSE of a candidate (RTT callbacks on: see pair_candidate): its pairing state
 * goes with it. Nothing can use that entry any more: this socket's own programs run under its lock
 * (and the socket is done), and an accepted end that looked it up just before finds it gone or,
 * should the element already hold another connection's state, a word with that connection's
 * identity: its compare-and-swap fails and it stays in the map (pair_passive), where what the
 * closed end sent stays readable. A connection's key is its own while it lives: the kernel
 * releases the local port after this callback. */
static __always_inline void pair_close(struct bpf_sock_ops *ctx, __u64 netns)
{
	struct pair_key k = {};

	PAIR_KEY(&k, ctx, netns, 0);
	pair_state.delete(&k);
}

/* Every send of a paired socket: to the peer's receive queue, or over TCP for good. */
int rdr_sk_msg(struct sk_msg_md *msg)
{
	struct pair_key peer = {}, own = {};
	struct bpf_sock *sk = msg->sk;
	struct pair_state *st;
	__u64 netns, *tcp, w;
	long r;

	if (!sk)
		return SK_PASS;
	if (pair_tcp.sk_storage_get(sk, 0, 0))
		return SK_PASS; /* this direction sent over TCP before */
	netns = bpf_get_netns_cookie(msg);
	PAIR_KEY(&peer, msg, netns, 1);
	r = pairs.msg_redirect_hash(msg, &peer, BPF_F_INGRESS);
	if (r == SK_PASS)
		return SK_PASS;
	/* No peer: the connecting end before the accepted end joined (then this end takes the
	 * connection to TCP, unless the accepted end has just joined: it is in the map), or a peer
	 * that closed. Its own entry is its own while it lives (unless evicted from a table full of
	 * live connections: then, too, the accepted end joined if it is in the map now). */
	PAIR_KEY(&own, msg, netns, 0);
	st = pair_state.lookup(&own);
	w = st ? st->state : 0;
	if (!st || PAIR_STATE_OF(w) != RDR_PAIR_OPEN ||
	    __sync_val_compare_and_swap(&st->state, w, (w & ~(__u64)RDR_PAIR_STATE_MASK) | RDR_PAIR_TCP) != w) {
		r = pairs.msg_redirect_hash(msg, &peer, BPF_F_INGRESS);
		if (r == SK_PASS)
			return SK_PASS;
	}
	tcp = pair_tcp.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (tcp)
		*tcp = 1;
	return SK_PASS;
}
