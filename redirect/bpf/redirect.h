/* Shared types and maps of the redirect eBPF backend.
 *
 * Every program here is attached host-wide (cgroup v2 root) or to a pod's
 * netns, and must be a strict no-op for any socket whose network namespace
 * cookie is not a key of `pods`: other processes on this host (and other
 * backends' tests) run under the same programs.
 *
 * The map layouts are in abi.h, shared with native/ and (through cffi)
 * redirect/backends/ebpf/abi.py.
 */
#ifndef RDR_REDIRECT_H
#define RDR_REDIRECT_H

#include <uapi/linux/bpf.h>
#include <uapi/linux/in.h>
#include <uapi/linux/in6.h>

/* The programs are compiled against UAPI headers only (redirect/bpf/headers/): socket types
 * and address families are in the kernel's include/linux/net.h and include/linux/socket.h,
 * which are not UAPI. */
#ifndef SOCK_STREAM
#define SOCK_STREAM 1
#define SOCK_DGRAM 2
#endif
#ifndef AF_INET
#define AF_INET 2
#define AF_INET6 10
#endif

#include "abi.h" /* the map keys and values */

BPF_HASH(pods, __u64, struct pod_policy, 4096);
BPF_F_TABLE("hash", struct inv_key, struct inv_val, inventory, 65536, BPF_F_NO_PREALLOC);
BPF_HASH(ports, struct port_key, __u8, 65536);
BPF_LPM_TRIE(cidrs, struct cidr_key, __u8, 65536);
/* sk_lookup can't ask for its netns cookie (the verifier refuses
 * bpf_get_netns_cookie there), so each pod's netns gets a program of its own:
 * a stub that holds a slot number as a constant (native/redirect_native.c,
 * rdr_ebpf_pool_prog), reads the pod's netns cookie from lookup_slots[slot],
 * stores it in lookup_netns and tail-calls rdr_sk_lookup (lookup_prog[0]),
 * which reads it back and zeroes it. TCP's lookups run with bottom halves
 * off, so nothing else runs on that CPU in between; a run that interrupts
 * another (a lookup from process context) completes, and leaves the slot
 * zero, never another pod's cookie. The stubs are loaded ahead, a batch at a
 * time, and kept in lookup_pool; a slot is claimed for a pod (BPF_NOEXIST in
 * lookup_slots) and released to lookup_free at its teardown. lookup_free is a
 * queue of slot numbers: a claim pops one (constant time, where the first key
 * of a sparse hash is a walk of its buckets); a slot may be in it twice, or be
 * claimed already (the claim then drops it). Only user space reads
 * lookup_pool and lookup_free. */
BPF_PERCPU_ARRAY(lookup_netns, __u64, 1);
BPF_PROG_ARRAY(lookup_prog, 1);
BPF_HASH(lookup_slots, __u32, struct pool_slot, RDR_POOL_MAX);
BPF_QUEUE(lookup_free, __u32, RDR_POOL_MAX);
BPF_PROG_ARRAY(lookup_pool, RDR_POOL_MAX);
/* Staging: socket cookie -> original dst, from connect4/6 until sock_ops
 * sees the local port (TCP_CONNECT_CB). LRU, so a connect that fails before
 * then can't leak an entry forever. */
BPF_TABLE("lru_hash", __u64, struct orig_dst, orig_by_cookie, 65536);
/* Client 4-tuple half -> original dst, read by the getsockopt program. */
BPF_TABLE("lru_hash", struct tuple_key, struct orig_dst, orig_by_tuple, 65536);
/* A TCP connection made inside a pod from a source that is not the pod's (a proxy's transparent
 * connection to the app from the client's address: ambient's node proxy, TPROXY's original_src),
 * keyed by both ends as its connecting socket sees them, from sock_ops' TCP_CONNECT_CB until the
 * socket closes. Such a connection is locally generated, which netfilter's nat PREROUTING never
 * sees; sk_lookup sees it as inbound from afar, and passes it by this entry
 * (redirect/bpf/sockopt.c, redirect/bpf/sk_lookup.c). */
BPF_TABLE("lru_hash", struct pair_key, __u8, local_conns, 65536);
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
/* sockmap (redirect/bpf/sockmap.c): both ends of the pods' app <-> proxy connections, each under
 * its own pair_key; rdr_sk_msg runs on every send of a socket in it. A socket leaves when it
 * closes (the kernel removes it) or, never having been sent anything, when its own sends went
 * over TCP first. */
BPF_SOCKHASH(pairs, struct pair_key, 65536);
BPF_TABLE("lru_hash", struct pair_key, struct pair_state, pair_state, 65536);
/* A socket whose send went over TCP never redirects again (the peer would read the redirected
 * bytes first): socket-local storage, made only then, so the check is a NULL pointer otherwise. */
BPF_SK_STORAGE(pair_tcp, __u64);

#endif
