/* The eBPF backend's per-pod writing, and its setup of a fresh pod in one call.
 *
 * rdr_ebpf_pod_write is the one writer of a pod's state: given what the pod is to have and what
 * it has (its inventory), it writes the difference (the intent's address on lo, ::6, the
 * inventory, the new keys, listeners, the sk_lookup link running the program of a pool slot
 * claimed for the pod, pinned at <pin_dir>/<cookie>-sk_lookup, the tc filters, and the policy
 * last: it switches capture on), then deletes what only the old state had; a failure on the way
 * undoes everything written, in reverse. It writes through one host handle's objects, struct
 * rdr_host_maps: all it knows of the host side. A changed config's keys are in the pod's other
 * generation (redirect/bpf/policy.h, pod_keys), which the old policy does not read: until the
 * policy write the pod captures exactly what the old config does.
 *
 * Two callers: redirect/backends/ebpf/pod/apply.py (any pod, any previous state) computes the
 * difference in Python and calls it; rdr_ebpf_pod_add below does the common case, a pod that has
 * nothing of ours yet (a CNI ADD, a sidecar init), in one call: the writer from an empty
 * inventory, of the entries the eBPF lowering computed once per config in Python
 * (redirect/backends/ebpf/pod/fresh.py, struct rdr_pod_set), with the pod's netns cookie and
 * addresses put in their fields. The Python path spends about as long in the interpreter as in
 * the kernel, and this spends ~nothing there. Both scan the netns with rdr_scan_netns and look
 * for the proxy's listener with rdr_inbound_listener_maybe.
 *
 * When the pod is not fresh (a policy, something on the proxy's inbound port, an address a plan
 * adds there already) rdr_ebpf_pod_add returns RDR_POD_SLOW before changing anything; leftovers
 * of an earlier attempt (entries, a pinned link) are found by the writes themselves (BPF_NOEXIST,
 * EEXIST), which are then undone before it returns RDR_POD_SLOW. Either way the pod is as it was
 * and the caller takes the general path.
 *
 * Around that it does what redirect.setup's general path does in Python: opens the netns, takes
 * its lock (rdr_netns_lock, on the caller thread's own fd of the lock file: the lock
 * redirect.kernel.locks takes through the same function), enters, and comes back. A pod's setup
 * runs between other work, with cold caches: every distinct kernel path and line of Python on the
 * way is paid in cache and TLB refills, so taking fewer of them is what counts
 * (docs/kernel-facts.md, "Short calls after other work").
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <linux/if_addr.h>
#include <linux/netlink.h>
#include <linux/inet_diag.h>
#include <linux/rtnetlink.h>
#include <linux/fib_rules.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <sched.h>
#include <stddef.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "abi.h"
#include "netlink.h"
#include "redirect_native.h"

#ifndef IFA_PROTO
#define IFA_PROTO 11
#endif

#define MAX_ITEMS 256 /* entries of one pod on this path; more go the general way */

/* A key written by rdr_ebpf_pod_write, for its undo. */
struct written {
	int fd;
	const void *key;
};

/* --- netlink ------------------------------------------------------------- */

static const uint8_t V6_LOOPBACK[16] = {[15] = 1};

/* fe80::/10: an IPv6 link-local address (its interface is part of it: a socket names it by scope id). */
static int v6_link_local(const uint8_t addr[16])
{
	return addr[0] == 0xfe && (addr[1] & 0xc0) == 0x80;
}

/* A scan under way: the addresses of lo with this routing protocol (IFA_PROTO, 0: none) are ours
 * (the intent's ::6), held beside the pod's own RDR_SCAN_MAX. */
struct scan_ctx {
	struct rdr_netns_scan *sc;
	uint8_t ours_proto;
};

/* One address of the dump (rdr_nl_dump) into the scan (arg): loopback aside. An IPv6 link-local
 * address is one of the pod's own as any other is: a connection to it goes over lo, as the
 * netfilter backends see it (the app's to its own link-local address is not captured), and one
 * from it is the pod talking to itself. It is never a source the hooks give (rdr_pod_sources). */
static int on_address(void *arg, const struct nlmsghdr *h)
{
	const struct scan_ctx *x = arg;
	struct rdr_netns_scan *sc = x->sc;
	const struct ifaddrmsg *ifa;
	const struct rtattr *rta;
	const uint8_t *local = NULL, *addr = NULL;
	int alen, proto = 0, ours;
	uint32_t flags;

	if (h->nlmsg_type != RTM_NEWADDR)
		return 0;
	ifa = NLMSG_DATA(h);
	flags = ifa->ifa_flags;
	alen = IFA_PAYLOAD(h);
	for (rta = IFA_RTA(ifa); RTA_OK(rta, alen); rta = RTA_NEXT(rta, alen)) {
		if (rta->rta_type == IFA_LOCAL)
			local = RTA_DATA(rta);
		else if (rta->rta_type == IFA_ADDRESS)
			addr = RTA_DATA(rta);
		else if (rta->rta_type == IFA_PROTO && RTA_PAYLOAD(rta) >= 1)
			proto = *(const uint8_t *)RTA_DATA(rta);
		else if (rta->rta_type == IFA_FLAGS && RTA_PAYLOAD(rta) >= 4)
			memcpy(&flags, RTA_DATA(rta), 4);
	}
	if (local == NULL)
		local = addr;
	if (local == NULL)
		return 0;
	/* An IPv6 address whose duplicate address detection failed is not the pod's: the kernel neither
	 * delivers to it nor sends from it (it stays tentative). One still tentative is kept: it
	 * becomes usable once DAD is done, typically within a second of being added, when a pod's
	 * setup often runs. This is the one place both paths read addresses from (and so where the
	 * pod's sources come from, rdr_pod_sources). */
	if (ifa->ifa_family == AF_INET6 && (flags & IFA_F_DADFAILED))
		return 0;
	if (ifa->ifa_family == AF_INET) {
		if (local[0] == 127)
			return 0;
	} else if (ifa->ifa_family == AF_INET6) {
		sc->v6_on = 1;
		if (memcmp(local, V6_LOOPBACK, 16) == 0)
			return 0;
	} else {
		return 0;
	}
	/* Ours (on lo, with our protocol) do not count against the pod's RDR_SCAN_MAX. */
	ours = ifa->ifa_index == 1 && x->ours_proto && proto == x->ours_proto;
	if (ours ? sc->n_ours == RDR_SCAN_OURS : sc->n - sc->n_ours == RDR_SCAN_MAX)
		return -E2BIG;
	sc->a[sc->n].family = ifa->ifa_family == AF_INET ? 4 : 6;
	sc->a[sc->n].ifindex = (int)ifa->ifa_index;
	memset(sc->a[sc->n].addr, 0, 16);
	memcpy(sc->a[sc->n].addr, local, ifa->ifa_family == AF_INET ? 4 : 16);
	sc->n++;
	sc->n_ours += ours;
	return 0;
}
_Static_assert(RDR_SCAN_CAP == RDR_SCAN_MAX + RDR_SCAN_OURS, "room for the pod's addresses and ours");

/* Before each dump of scan_addresses: nothing found yet (the cookie stays). */
static void scan_reset(void *arg)
{
	struct rdr_netns_scan *sc = ((struct scan_ctx *)arg)->sc;

	sc->v6_on = sc->n = sc->n_ours = 0;
}

/* One RTM_GETADDR dump of every family: the pod's addresses (loopback aside), whether IPv6 is on
 * (made again while the kernel flags it inconsistent, rdr_nl_dump_whole: -EINTR when every one was).
 *
 * A buffer is one page: the kernel sizes each later batch of a dump by the largest buffer a
 * recv offered (up to 32 KB), and a batch over a page comes from the page allocator, a slower
 * path than the slab caches (docs/kernel-facts.md), paid for the NLMSG_DONE alone; a first batch
 * is at most a page less its overhead on 4 KB pages. A batch that does not fit (larger pages) fails the scan (-EMSGSIZE). */
static int scan_addresses(int s, struct rdr_netns_scan *sc, uint8_t ours_proto)
{
	struct ifaddrmsg m = {.ifa_family = AF_UNSPEC};
	struct scan_ctx x = {.sc = sc, .ours_proto = ours_proto};
	struct rdr_nlreq req;
	char buf[2][4096] __attribute__((aligned(8)));

	rdr_nl_start(&req, RTM_GETADDR, 0, &m, sizeof(m));
	return rdr_nl_dump_whole(s, &req.h, buf[0], sizeof(buf[0]), on_address, scan_reset, &x);
}

int rdr_scan_netns(struct rdr_netns_scan *sc, uint8_t ours_proto)
{
	int s, ret;

	memset(sc, 0, offsetof(struct rdr_netns_scan, a)); /* the addresses are written as found */
	s = rdr_nl_socket(NETLINK_ROUTE);
	if (s < 0)
		return s;
	ret = rdr_sock_netns_cookie(s, &sc->cookie);
	if (ret >= 0)
		ret = scan_addresses(s, sc, ours_proto);
	close(s);
	return ret < 0 ? ret : 0;
}

/* RTM_NEWADDR / RTM_DELADDR of addr/128 on lo, with our routing protocol; waits for the ack. */
static int v6_lo_addr(int s, int add, const uint8_t addr[16], uint8_t proto, uint32_t flags)
{
	struct ifaddrmsg m = {.ifa_family = AF_INET6, .ifa_prefixlen = 128, .ifa_flags = (uint8_t)(flags & 0xff),
			      .ifa_index = 1}; /* lo, in every netns */
	struct rdr_nlreq req;

	rdr_nl_start(&req, add ? RTM_NEWADDR : RTM_DELADDR, add ? NLM_F_CREATE | NLM_F_EXCL : 0, &m, sizeof(m));
	rdr_nl_attr(&req, IFA_LOCAL, addr, 16);
	rdr_nl_attr(&req, IFA_ADDRESS, addr, 16);
	if (add) {
		rdr_nl_attr(&req, IFA_FLAGS, &flags, 4);
		rdr_nl_attr(&req, IFA_PROTO, &proto, 1);
	}
	return rdr_nl_talk(s, &req.h, NULL, 0);
}

/* One op (redirect_native.h) as its request: a rule (struct fib_rule_hdr, whose layout is an rtmsg's)
 * or a route, their table in the header when it fits (else RT_TABLE_COMPAT) and as an attribute. */
static void route_op_msg(struct rdr_nlreq *q, const struct rdr_route_op *op)
{
	uint16_t flags = op->add ? NLM_F_CREATE | NLM_F_EXCL : 0;
	uint32_t oif = (uint32_t)op->oif;
	struct rtmsg *m;

	if (op->kind == RDR_RT_RULE) {
		m = rdr_nl_start(q, op->add ? RTM_NEWRULE : RTM_DELRULE, flags, NULL, sizeof(struct fib_rule_hdr));
		((struct fib_rule_hdr *)m)->action = FR_ACT_TO_TBL;
	} else {
		m = rdr_nl_start(q, op->add ? RTM_NEWROUTE : RTM_DELROUTE, flags, NULL, sizeof(*m));
		m->rtm_protocol = op->proto;
		m->rtm_scope = RT_SCOPE_HOST;
		m->rtm_type = RTN_LOCAL;
	}
	m->rtm_family = op->family == 6 ? AF_INET6 : AF_INET;
	m->rtm_table = op->table < 256 ? (uint8_t)op->table : RT_TABLE_COMPAT;
	if (op->kind == RDR_RT_RULE) {
		rdr_nl_attr(q, FRA_PRIORITY, &op->priority, 4);
		rdr_nl_attr(q, FRA_FWMARK, &op->fwmark, 4);
		rdr_nl_attr(q, FRA_FWMASK, &op->mask, 4);
		rdr_nl_attr(q, FRA_TABLE, &op->table, 4);
		/* On a delete too: without it, the kernel deletes the first rule that matches the
		 * rest, which may be another's with the same selector and table (Istio's own). */
		rdr_nl_attr(q, FRA_PROTOCOL, &op->proto, 1);
	} else {
		rdr_nl_attr(q, RTA_TABLE, &op->table, 4);
		rdr_nl_attr(q, RTA_OIF, &oif, 4);
	}
}

int rdr_route_ops(int s, const struct rdr_route_op *ops, uint32_t n, int *errs)
{
	struct rdr_nlreq q;
	char msgs[RDR_ROUTE_OPS_MAX * 96] __attribute__((aligned(8))); /* (a request is at most 76 bytes) */
	char buf[RDR_NL_RECV_MAX][512] __attribute__((aligned(8)));
	size_t len = 0;
	int own = s < 0, ret;

	for (uint32_t i = 0; i < n && i < RDR_ROUTE_OPS_MAX; i++)
		errs[i] = -EPROTO;
	if (n > RDR_ROUTE_OPS_MAX)
		return -E2BIG;
	if (n == 0)
		return 0;
	for (uint32_t i = 0; i < n; i++) {
		route_op_msg(&q, &ops[i]);
		q.h.nlmsg_flags |= NLM_F_ACK;
		if (len + NLMSG_ALIGN(q.h.nlmsg_len) > sizeof(msgs))
			return -E2BIG;
		memcpy(msgs + len, &q, q.h.nlmsg_len);
		len += NLMSG_ALIGN(q.h.nlmsg_len);
	}
	if (own) {
		s = rdr_nl_socket(NETLINK_ROUTE);
		if (s < 0)
			return s;
	}
	/* (an ack or an error a request: each answer is one datagram) */
	ret = rdr_nl_batch(s, msgs, len, (int)n, errs, buf[0], sizeof(buf[0]));
	if (own)
		close(s);
	return ret;
}

/* Remove what the n ops (adds) added, in reverse (each rule before its route): all of them, or
 * with errs only those whose errs[i] is 0 (the adds that succeeded). */
static void routes_undo(int s, const struct rdr_route_op *ops, uint32_t n, const int *errs)
{
	struct rdr_route_op undo[RDR_POD_ROUTE_OPS_MAX];
	int undo_errs[RDR_POD_ROUTE_OPS_MAX];
	uint32_t k = 0;

	for (uint32_t i = n < RDR_POD_ROUTE_OPS_MAX ? n : RDR_POD_ROUTE_OPS_MAX; i-- > 0;)
		if (errs == NULL || errs[i] == 0) {
			undo[k] = ops[i];
			undo[k++].add = 0;
		}
	rdr_route_ops(s, undo, k, undo_errs);
}

/* Add the n ops of a pod's policy routes (adds, in order), all or none: 0, or the first failure's
 * -errno with the ops that succeeded undone. */
static int routes_add(int s, const struct rdr_route_op *ops, uint32_t n)
{
	int errs[RDR_POD_ROUTE_OPS_MAX], ret;

	if (n > RDR_POD_ROUTE_OPS_MAX)
		return -E2BIG;
	ret = rdr_route_ops(s, ops, n, errs);
	for (uint32_t i = 0; ret == 0 && i < n; i++)
		if (errs[i] != 0)
			ret = errs[i];
	if (ret != 0)
		routes_undo(s, ops, n, errs);
	return ret;
}

/* --- the pod ----------------------------------------------------------------- */

static int has_item(const struct rdr_pod_entry *it, int n, const struct rdr_pod_entry *x)
{
	for (int i = 0; i < n; i++)
		if (it[i].map == x->map && memcmp(it[i].key, x->key, sizeof(x->key)) == 0)
			return 1;
	return 0;
}

static int add_item(struct rdr_pod_entry *it, int *n, int map, int size, const void *key)
{
	struct rdr_pod_entry x;

	memset(&x, 0, sizeof(x));
	x.map = (uint32_t)map;
	memcpy(x.key, key, (size_t)size);
	if (has_item(it, *n, &x))
		return 0;
	if (*n == MAX_ITEMS)
		return -E2BIG;
	it[(*n)++] = x;
	return 0;
}

/* --- the proxy's inbound listener ------------------------------------------------ */

#define LISTEN_STATE (1 << 10) /* 1 << TCP_LISTEN */

/* Does a TCP listener take connections to `port` at 127.0.0.1, at ::1 (if v6) or at one of the
 * pod's addresses in sc? One exact sock_diag look-up each (the kernel's own listener look-up,
 * wildcard binds included), all in one message: 1 none does, 0 one does or can't tell. About
 * half the cost of a bind probe (a TCP socket made, bound and closed). */
static int no_listener(uint16_t port, int fams, const struct rdr_netns_scan *sc)
{
	struct {
		struct nlmsghdr h;
		struct inet_diag_req_v2 r;
	} q[2 + RDR_SCAN_CAP];
	char buf[RDR_NL_RECV_MAX][1024] __attribute__((aligned(8)));
	int answers[2 + RDR_SCAN_CAP];
	int s, n = 0, ret;

	for (int i = -2; i < sc->n; i++) {
		int fam = i == -2 ? 4 : i == -1 ? 6 : sc->a[i].family;

		if (!(fams & (fam == 4 ? RDR_FAM4 : RDR_FAM6)))
			continue;
		memset(&q[n], 0, sizeof(q[0])); /* only what is sent: the stack lines are cold */
		q[n].h.nlmsg_len = sizeof(q[0]);
		q[n].h.nlmsg_type = SOCK_DIAG_BY_FAMILY;
		q[n].h.nlmsg_flags = NLM_F_REQUEST;
		q[n].r.sdiag_family = fam == 4 ? AF_INET : AF_INET6;
		q[n].r.sdiag_protocol = IPPROTO_TCP;
		q[n].r.idiag_states = LISTEN_STATE;
		/* "src" is the local end: a connection from that address to itself, port 1 -> port */
		q[n].r.id.idiag_sport = htons(port);
		q[n].r.id.idiag_dport = htons(1);
		q[n].r.id.idiag_cookie[0] = q[n].r.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
		if (i >= 0) {
			memcpy(q[n].r.id.idiag_src, sc->a[i].addr, 16);
			memcpy(q[n].r.id.idiag_dst, sc->a[i].addr, 16);
			/* (a listener on a link-local address is bound to its interface: found there) */
			if (fam == 6 && v6_link_local(sc->a[i].addr))
				q[n].r.id.idiag_if = (uint32_t)sc->a[i].ifindex;
		} else if (fam == 4) {
			q[n].r.id.idiag_src[0] = q[n].r.id.idiag_dst[0] = htonl(0x7f000001);
		} else {
			q[n].r.id.idiag_src[3] = q[n].r.id.idiag_dst[3] = htonl(1);
		}
		n++;
	}
	s = rdr_nl_socket(NETLINK_SOCK_DIAG);
	if (s < 0)
		return 0;
	/* One answer a question (a datagram each): the socket found, or ENOENT. An answer too large
	 * for "none", or one missing, is not "none". */
	ret = rdr_nl_batch(s, q, sizeof(q[0]) * (size_t)n, n, answers, buf[0], sizeof(buf[0]));
	close(s);
	for (int i = 0; ret == 0 && i < n; i++)
		if (answers[i] != -ENOENT)
			return 0; /* a listener, or an answer we can't read as "none" */
	return ret == 0;
}

/* ENOENT is also what sock_diag answers when it has no TCP handler (tcp_diag not built or
 * loaded): an empty dump tells the two apart, once per process. */
static int on_any(void *arg, const struct nlmsghdr *h)
{
	(void)arg;
	(void)h;
	return 1;
}

int rdr_tcp_diag_ok(void)
{
	struct inet_diag_req_v2 r = {.sdiag_family = AF_INET, .sdiag_protocol = IPPROTO_TCP,
				     .idiag_states = 0}; /* no state: nothing to walk, just DONE */
	struct rdr_nlreq req;
	char buf[2][4096] __attribute__((aligned(8)));
	int s, ret;

	s = rdr_nl_socket(NETLINK_SOCK_DIAG);
	if (s < 0)
		return 0;
	rdr_nl_start(&req, SOCK_DIAG_BY_FAMILY, 0, &r, sizeof(r));
	ret = rdr_nl_dump(s, &req.h, buf[0], sizeof(buf[0]), on_any, NULL);
	close(s);
	return ret == 0;
}

/* Is TCP `port` free in this netns for the families asked (RDR_FAM4, RDR_FAM6)? 1 free, 0 held
 * or can't tell. */
static int port_free(uint16_t port, int fams)
{
	union {
		struct sockaddr sa;
		struct sockaddr_in a4;
		struct sockaddr_in6 a6;
	} a;
	int s, ok, v6only = fams == RDR_FAM6;

	memset(&a, 0, sizeof(a));
	if (fams & RDR_FAM6) { /* both: one dual-stack bind, it conflicts with IPv4 and IPv6 holders alike */
		a.a6.sin6_family = AF_INET6;
		a.a6.sin6_port = htons(port);
	} else {
		a.a4.sin_family = AF_INET;
		a.a4.sin_port = htons(port);
	}
	s = socket(a.sa.sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0)
		return 0;
	ok = (!(fams & RDR_FAM6) || setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof(v6only)) == 0) &&
	     bind(s, &a.sa, (fams & RDR_FAM6) ? sizeof(a.a6) : sizeof(a.a4)) == 0;
	close(s);
	return ok;
}

int rdr_inbound_listener_maybe(uint16_t port, int fams, const struct rdr_netns_scan *sc, int tcp_diag)
{
	if (!fams)
		return 0;
	return tcp_diag ? !no_listener(port, fams, sc) : !port_free(port, fams);
}

/* The netns lock (redirect_native.h): an OFD lock of one byte, held by the open file description,
 * so another thread's own open of the file conflicts as another process's does (and so do the
 * POSIX record locks of older versions). The one statement of that lock: redirect.kernel.locks
 * takes it through here too. */
int rdr_netns_lock(int fd, uint64_t ino, int lock)
{
	struct flock fl;

	memset(&fl, 0, sizeof(fl));
	fl.l_type = lock ? F_WRLCK : F_UNLCK;
	fl.l_whence = SEEK_SET;
	fl.l_start = (off_t)ino;
	fl.l_len = 1;
	return fcntl(fd, F_OFD_SETLK, &fl) == 0 ? 0 : -errno;
}

/* REDIRECT_FAULT (fault injection for the tests, as redirect.backends.base.fault_point reads
 * it): 1 after the address, before the entries; 2 before the policy; 3 once the pod's pool slot
 * is claimed, before its link; 4 after the policy, before net.ipv4.tcp_fwmark_accept is turned on
 * (the fresh-pod call; the general path's is in Python); 0 none; negative with ":kill" appended
 * (SIGKILL there). */
static int fault_at(void)
{
	static const char *const names[] = {"ebpf.before_entries", "ebpf.before_policy", "ebpf.after_claim",
					    "ebpf.before_fwmark_accept"};
	const char *f = getenv("REDIRECT_FAULT");

	if (f == NULL)
		return 0;
	for (int i = 0; i < 4; i++) {
		size_t n = strlen(names[i]);

		if (strncmp(f, names[i], n) == 0 && (f[n] == 0 || strcmp(f + n, ":kill") == 0))
			return f[n] ? -(i + 1) : i + 1;
	}
	return 0;
}

/* Is fault point `here` (1, 2, 3, 4) the one asked for (at: fault_at())? A ":kill" one kills. */
static int fault_here(int at, int here)
{
	if (at == -here)
		kill(getpid(), SIGKILL);
	return at == here;
}

static uint64_t now_ns(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t); /* the vDSO: no syscall */
	return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

const char rdr_pod_link_suffix[] = "-sk_lookup";

const char *const rdr_pod_step_names[RDR_STEPS] = {
	[RDR_STEP_OPEN] = "open", [RDR_STEP_ENTER] = "enter", [RDR_STEP_SCAN] = "scan", [RDR_STEP_FRESH] = "fresh",
	[RDR_STEP_LISTENER] = "listener", [RDR_STEP_SYSCTL] = "sysctl", [RDR_STEP_FORWARDING] = "forwarding",
	[RDR_STEP_ROUTES] = "routes", [RDR_STEP_MAPS] = "maps", [RDR_STEP_LINK] = "link", [RDR_STEP_TC] = "tc",
	[RDR_STEP_POLICY] = "policy", [RDR_STEP_LEAVE] = "leave",
};
_Static_assert(sizeof(((struct rdr_pod_call *)0)->step_ns) == RDR_STEPS * sizeof(uint32_t), "one time per step");

/* The time since the step under way started goes to step i (c may be NULL: not timed). */
static void step_done(struct rdr_pod_call *c, int i)
{
	uint64_t t;

	if (c == NULL)
		return;
	t = now_ns();
	c->step_ns[i] += (uint32_t)(t - c->step_at);
	c->step_at = t;
}

/* --- the pods' sk_lookup programs: a pool of slots ---------------------------------------------- */

/* The program of pool slot s kept open in w's cache (the host handle's: a slot's program never
 * changes while its lookup_pool does), or -1. */
static int cached_prog(const struct rdr_host_maps *h, uint32_t s)
{
	return h->prog_fds ? __atomic_load_n(&h->prog_fds[s], __ATOMIC_ACQUIRE) : -1;
}

/* The pool's program cache (redirect_native.h). */
int rdr_prog_cache_put(int *fds, int *n_fds, uint32_t s, int prog)
{
	int none = -1;

	if (!fds || !n_fds || s >= RDR_POOL_MAX || __atomic_load_n(n_fds, __ATOMIC_RELAXED) >= RDR_PROG_CACHE)
		return 0;
	if (!__atomic_compare_exchange_n(&fds[s], &none, prog, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED))
		return 0;
	__atomic_add_fetch(n_fds, 1, __ATOMIC_RELAXED);
	return 1;
}

/* Claim a pool slot for the pod (redirect/bpf/redirect.h, lookup_slots): one popped from the lookup_free
 * queue, else, none being queued, the first unclaimed one from slot_hint on. The claim
 * (BPF_NOEXIST) is what makes a slot ours; the queue only says where to try, so a slot popped
 * there that is claimed already (queued twice, or claimed by such a scan) is dropped from it. The
 * slot's program comes from the cache, else from lookup_pool, else it is loaded now and kept
 * there. *low is set when the queue was empty (the caller loads a batch ahead of the next pods).
 * The program's fd (*slot: its slot, claimed; *cached: the cache owns the fd) or -errno (nothing
 * claimed). */
static int pool_claim(const struct rdr_pod_write *w, uint32_t *slot, int *low, int *cached)
{
	const struct rdr_host_maps *h = w->host;
	struct pool_slot v = {.netns = w->cookie, .netns_ino = w->netns_ino};
	uint32_t hint = h->slot_hint ? *h->slot_hint : 0;
	uint32_t s = 0, id;
	int ret, prog, tries;

	*cached = 0;
	for (tries = 0; tries < 64; tries++) {
		ret = rdr_bpf_map_pop(h->free, &s);
		if (ret == -ENOENT)
			break;
		if (ret < 0)
			return ret;
		if (s >= RDR_POOL_MAX)
			continue;
		ret = rdr_bpf_map_update(h->slots, &s, &v, BPF_NOEXIST);
		if (ret == 0)
			goto claimed;
		if (ret != -EEXIST) {
			rdr_bpf_map_push(h->free, &s); /* still free */
			return ret;
		}
	}
	*low = 1;
	for (uint32_t i = 0; i < RDR_POOL_MAX; i++) {
		s = (hint + i) % RDR_POOL_MAX;
		ret = rdr_bpf_map_update(h->slots, &s, &v, BPF_NOEXIST);
		if (ret == 0)
			goto claimed;
		if (ret != -EEXIST)
			return ret;
	}
	return -ENOSPC;
claimed:
	*slot = s;
	prog = cached_prog(h, s);
	if (prog >= 0) {
		*cached = 1;
		return prog;
	}
	prog = -1;
	if (rdr_bpf_map_lookup(h->pool, &s, &id) == 0) /* a program array answers with the id */
		prog = rdr_bpf_prog_get_fd_by_id(id);
	if (prog < 0) {
		prog = rdr_ebpf_pool_prog(h->slots, h->lookup_netns, h->lookup_prog, s);
		if (prog < 0) {
			rdr_bpf_map_delete(h->slots, &s);
			return prog;
		}
		rdr_bpf_map_update(h->pool, &s, &prog, BPF_ANY); /* kept for the pods after this one */
	}
	*cached = rdr_prog_cache_put(h->prog_fds, h->n_prog_fds, s, prog);
	return prog;
}

/* Give a claimed slot back: its claim goes, and it is queued free again. */
static void pool_release(const struct rdr_pod_write *w, uint32_t s)
{
	rdr_bpf_map_delete(w->host->slots, &s);
	rdr_bpf_map_push(w->host->free, &s);
}

/* The eBPF backend's one writer of a pod's entries (redirect_native.h). */
int rdr_ebpf_pod_write(const struct rdr_pod_write *w)
{
	const struct rdr_host_maps *h = w->host;
	uint32_t n = w->n_entries, nchunks = (n + RDR_INV_CHUNK - 1) / RDR_INV_CHUNK;
	struct written *done = malloc(((size_t)n + nchunks + 1) * sizeof(*done));
	struct inv_key *iks = malloc(((size_t)nchunks + 1) * sizeof(*iks));
	struct rdr_tc_made *tcm = calloc((size_t)w->n_tc + 1, sizeof(*tcm)); /* what each attach changed */
	struct listener_key lks[2];
	struct pod_policy policy;
	uint8_t cookie_v[8], one = 1;
	uint32_t slot = 0;
	char pin[4096];
	int nd = 0, ret = 0, link = -1, pinned = 0, claimed = 0, low = 0, at = fault_at(), nl = w->nl, addr_added = 0;
	uint32_t tc_done = 0;
	int32_t tc_slot;

	if (done == NULL || iks == NULL || tcm == NULL) {
		ret = -ENOMEM;
		goto out;
	}
	memcpy(cookie_v, &w->cookie, 8);
	memset(lks, 0, sizeof(lks));
	for (int f = 0; f < 2; f++) {
		lks[f].netns = w->cookie;
		lks[f].family = f ? AF_INET6 : AF_INET;
	}
	if (w->add_v6) { /* (the intent's address for the proxy's inbound passthrough, ::6) */
		if (nl < 0)
			nl = rdr_nl_socket(NETLINK_ROUTE);
		ret = nl < 0 ? nl : v6_lo_addr(nl, 1, w->add_v6, w->addr_proto, w->addr_flags);
		if (ret < 0 && ret != -EEXIST)
			goto undo;
		addr_added = ret == 0;
	}
	if (fault_here(at, 1)) {
		ret = RDR_POD_FAULT;
		goto undo;
	}
	for (uint32_t c = 0; c < nchunks; c++) {
		struct inv_val v;

		memset(&v, 0, sizeof(v));
		for (uint32_t j = 0; j < RDR_INV_CHUNK && c * RDR_INV_CHUNK + j < n; j++) {
			v.map[j] = w->entries[c * RDR_INV_CHUNK + j].map;
			memcpy(v.key[j], w->entries[c * RDR_INV_CHUNK + j].key, RDR_INV_KEY_MAX);
		}
		memset(&iks[c], 0, sizeof(iks[c]));
		iks[c].netns = w->cookie;
		iks[c].idx = w->inv_base + c;
		ret = rdr_bpf_map_update(h->inventory, &iks[c], &v, w->update_flags);
		if (ret < 0)
			goto undo;
		done[nd].fd = h->inventory;
		done[nd++].key = &iks[c];
	}
	for (uint32_t i = 0; i < n; i++) {
		const struct rdr_pod_entry *e = &w->entries[i];
		int mfd = e->map == RDR_INV_PORTS ? h->ports : h->cidrs;

		if (e->have)
			continue;
		ret = rdr_bpf_map_update(mfd, e->key, &one, w->update_flags);
		if (ret < 0)
			goto undo;
		done[nd].fd = mfd;
		done[nd++].key = e->key;
	}
	step_done(w->call, RDR_STEP_MAPS);
	/* Listeners already open; the sock_ops program adds those opened later. */
	for (int f = 0; f < 2; f++) {
		uint64_t sfd = (uint64_t)w->listener_fd[f];

		if (w->listener_fd[f] < 0)
			continue;
		ret = rdr_bpf_map_update(h->listeners, &lks[f], &sfd, BPF_ANY);
		if (ret < 0)
			goto undo;
	}
	if (w->link_netns >= 0) {
		int cached, name, prog = pool_claim(w, &slot, &low, &cached);

		if (prog < 0) {
			ret = prog;
			goto undo;
		}
		claimed = 1;
		if (fault_here(at, 3)) {
			if (!cached)
				close(prog);
			ret = RDR_POD_FAULT;
			goto undo;
		}
		link = rdr_bpf_link_create(prog, w->link_netns, BPF_SK_LOOKUP, 0);
		if (!cached)
			close(prog); /* the link holds it */
		if (link < 0) {
			ret = link;
			goto undo;
		}
		/* Relative to the open pin dir where the kernel can (6.5), else by the whole path. */
		name = snprintf(pin, sizeof(pin), "%s/", h->pin_dir);
		if (name < 0 || (size_t)name >= sizeof(pin) ||
		    (size_t)snprintf(pin + name, sizeof(pin) - (size_t)name, "%llu%s",
				     (unsigned long long)w->cookie, rdr_pod_link_suffix) >= sizeof(pin) - (size_t)name) {
			ret = -ENAMETOOLONG;
			goto undo;
		}
		ret = h->pin_dir_fd >= 0 ? rdr_bpf_obj_pin_at(link, h->pin_dir_fd, pin + name) : -EINVAL;
		if (ret == -EINVAL)
			ret = rdr_bpf_obj_pin(link, pin);
		if (ret < 0)
			goto undo;
		pinned = 1;
		step_done(w->call, RDR_STEP_LINK);
	}
	/* The tc filters of the interfaces the pod forwards on (tc_filter.c), with its slot: before the
	 * policy, which makes their programs take what it captures. */
	tc_slot = claimed ? (int32_t)slot : w->slot_now;
	if (w->n_tc && (tc_slot < 0 || tc_slot >= RDR_POOL_MAX)) {
		ret = -ESRCH;
		goto undo;
	}
	for (; tc_done < w->n_tc; tc_done++) {
		ret = rdr_tc_attach(w->tc_ifs[tc_done], h->tc_prog_in, h->tc_prog_out, (uint32_t)tc_slot + 1,
				    &tcm[tc_done], w->tc_blame);
		if (ret < 0)
			goto undo;
	}
	if (w->n_tc)
		step_done(w->call, RDR_STEP_TC);
	if (fault_here(at, 2)) {
		ret = RDR_POD_FAULT;
		goto undo;
	}
	policy = *w->policy;
	policy.inv_base = w->inv_base;
	policy.n_inv = n;
	ret = rdr_bpf_map_update(h->pods, cookie_v, &policy, w->update_flags);
	if (ret < 0)
		goto undo;
	if (link >= 0)
		close(link);
	/* The previous config's leftovers, now that the new policy is live. */
	for (uint32_t i = 0; i < w->n_stale; i++)
		rdr_bpf_map_delete(w->stale[i].map == RDR_INV_PORTS ? h->ports : h->cidrs, w->stale[i].key);
	for (uint32_t i = 0; i < w->n_old_inv; i++)
		rdr_bpf_map_delete(h->inventory, &w->old_inv[i]);
	if (w->drop_listeners)
		for (int f = 0; f < 2; f++)
			rdr_bpf_map_delete(h->listeners, &lks[f]);
	while (tc_done > 0)
		rdr_tc_keep(&tcm[--tc_done]);
	step_done(w->call, RDR_STEP_POLICY);
	ret = 0;
	goto out;

undo:
	/* (Before the slot goes: a filter names it. Only what this write changed: a clsact qdisc that
	 * was there stays, and a filter of ours it replaced is put back.) */
	while (tc_done > 0)
		rdr_tc_undo(&tcm[--tc_done]);
	if (link >= 0) {
		rdr_bpf_link_detach(link);
		if (pinned)
			unlink(pin);
		close(link);
	}
	if (claimed) /* (after the link is gone: no netns runs the slot's program any more) */
		pool_release(w, slot);
	while (nd > 0) {
		nd--;
		rdr_bpf_map_delete(done[nd].fd, done[nd].key);
	}
	if (w->new_pod)
		for (int f = 0; f < 2; f++)
			rdr_bpf_map_delete(h->listeners, &lks[f]);
	if (addr_added)
		v6_lo_addr(nl, 0, w->add_v6, 0, 0);
out:
	if (nl >= 0 && nl != w->nl)
		close(nl);
	if (w->pool_low && low)
		*w->pool_low = 1;
	free(done);
	free(iks);
	free(tcm);
	return ret;
}

/* May this netns hold netfilter capture of ours? Not if the run dir's marks say so: every setup of
 * a netfilter backend first writes its netns's cookie there, at 8 times its inode, and the netns
 * there before the marks were made are marked unknown (all ones) with them
 * (redirect.kernel.locks.netfilter_marks). A netns with no mark, or with another netns's cookie
 * (its inode was reused), holds none. */
static int netfilter_maybe(const struct rdr_pod_req *r, uint64_t ino, uint64_t cookie)
{
	uint64_t m = 0;

	if (r->nf_marks_fd < 0 || !r->nf_marks_ready)
		return 1;
	/* (past the end of the file: no mark) */
	if (pread(r->nf_marks_fd, &m, sizeof(m), (off_t)(ino * sizeof(m))) < 0)
		return 1;
	return m == cookie || m == UINT64_MAX;
}

/* Is addr one of the IPv6 addresses a plan may add (r->ours_v6)? */
static int ours_v6(const struct rdr_pod_req *r, const uint8_t addr[16])
{
	for (uint32_t i = 0; i < r->n_ours_v6 && i < RDR_OURS_V6_MAX; i++)
		if (memcmp(r->ours_v6[i], addr, 16) == 0)
			return 1;
	return 0;
}

/* The pod's sources and the link-local address its policy holds (redirect_native.h). */
void rdr_pod_sources(const struct rdr_scan_addr *a, int n, const int has[2], uint8_t src4[4], uint8_t src6[16],
		     uint8_t ll6[16])
{
	for (int i = n - 1; i >= 0; i--) { /* (backwards: the first one is written last) */
		if (a[i].ifindex == 1 || (a[i].family != 4 && a[i].family != 6) || !has[a[i].family == 6])
			continue;
		if (a[i].family == 4)
			memcpy(src4, a[i].addr, 4);
		else if (v6_link_local(a[i].addr)) /* (a source only for a link-local destination, on its link) */
			memcpy(ll6, a[i].addr, 16);
		else
			memcpy(src6, a[i].addr, 16);
	}
}

/* Whether the scanned address a is the link-local one a policy holds (ll6, rdr_pod_sources): no
 * local6 entry of its own. */
static int held_by_policy(const struct rdr_scan_addr *a, const uint8_t ll6[16])
{
	return a->family == 6 && ll6[0] && memcmp(a->addr, ll6, 16) == 0;
}

/* net.ipv4.tcp_fwmark_accept of the calling thread's netns, opened to read and write: its fd, with
 * its value in *on, or -errno. It has no netlink interface: a sysctl look-up (rdr_sysctl_open), the
 * one of a setup. */
static int fwmark_accept_open(int *on)
{
	char v[16];
	int fd = rdr_sysctl_open("net/ipv4/tcp_fwmark_accept", O_RDWR);
	ssize_t n;

	if (fd < 0)
		return fd;
	n = pread(fd, v, sizeof(v) - 1, 0);
	if (n < 0) {
		n = -errno;
		close(fd);
		return (int)n;
	}
	v[n] = 0;
	*on = atoi(v);
	return fd;
}

/* Inside the pod netns (netns_fd), with the lock held. The entries are the lowering's (r->sets,
 * made in Python once per config), with the netns cookie and the pod's addresses put in their
 * fields: what this pod is to have, written as the difference from nothing. */
static int pod_add(const struct rdr_pod_req *r, struct rdr_pod_call *c, int netns_fd, uint64_t netns_ino)
{
	struct rdr_pod_entry items[MAX_ITEMS];
	struct rdr_pod_write w;
	struct rdr_netns_scan sc;
	const struct rdr_pod_set *set;
	struct pod_policy policy;
	uint8_t cookie_v[8];
	int s, ret, n = 0, own_v6 = 0, fw = -1, fw_on = 0, routed = 0;
	int tc_ifs[RDR_FWD_MAX];

	memset(&sc, 0, offsetof(struct rdr_netns_scan, a)); /* the addresses are written as found */
	s = rdr_nl_socket(NETLINK_ROUTE);
	if (s < 0)
		return RDR_POD_SLOW;
	if (rdr_sock_netns_cookie(s, &sc.cookie) < 0 || scan_addresses(s, &sc, r->addr_proto) < 0) {
		close(s);
		return RDR_POD_SLOW;
	}
	/* An address a plan adds, on lo already, may be ours from before: the general path tells by
	 * its protocol. Any other IPv6 address but a link-local one is one of the pod's own for the
	 * intent's addresses (routes.own_ipv6: Istio adds ::6 to a pod with IPv6 of its own). */
	for (int i = 0; i < sc.n; i++) {
		if (sc.a[i].family != 6 || v6_link_local(sc.a[i].addr))
			continue;
		if (!ours_v6(r, sc.a[i].addr))
			own_v6 = 1;
		else if (sc.a[i].ifindex == 1)
			goto slow;
	}
	set = &r->sets[sc.v6_on ? 1 : 0][own_v6];
	step_done(c, RDR_STEP_SCAN);
	c->cookie = sc.cookie;
	c->v6 = set->v6;
	memcpy(cookie_v, &sc.cookie, 8);

	/* Fresh? No policy for this cookie. Leftovers of an earlier attempt (entries, a pinned
	 * link) show as EEXIST below: every write is
	 * BPF_NOEXIST (the pin fails on an existing one), so nothing of theirs is overwritten,
	 * ours is undone, and the general path sorts it out. */
	ret = rdr_bpf_map_lookup(r->host->pods, cookie_v, &policy);
	if (ret != -ENOENT)
		goto slow;
	/* Nor netfilter capture of ours (the general path replaces it). */
	if (netfilter_maybe(r, netns_ino, sc.cookie) && rdr_netfilter_present() != 0)
		goto slow;
	step_done(c, RDR_STEP_FRESH);

	/* The entries: the config's, then the pod's own addresses in the set's key of their family. */
	for (uint32_t i = 0; i < set->n_ports; i++) {
		struct port_key k = set->ports[i];

		k.netns = sc.cookie;
		if (add_item(items, &n, RDR_INV_PORTS, sizeof(k), &k) < 0)
			goto slow;
	}
	for (uint32_t i = 0; i < set->n_cidrs; i++) {
		struct cidr_key k = set->cidrs[i];

		k.netns = sc.cookie;
		if (add_item(items, &n, RDR_INV_CIDRS, sizeof(k), &k) < 0)
			goto slow;
	}
	policy = *set->policy;
	rdr_pod_sources(sc.a, sc.n, set->has_local, policy.src4, policy.src6, policy.ll6);
	for (int i = 0; i < sc.n; i++) {
		int f = sc.a[i].family == 6;
		struct cidr_key k = set->local[f];

		if (!set->has_local[f] || held_by_policy(&sc.a[i], policy.ll6))
			continue;
		k.netns = sc.cookie;
		memcpy(k.addr, sc.a[i].addr, sizeof(k.addr));
		if (add_item(items, &n, RDR_INV_CIDRS, sizeof(k), &k) < 0)
			goto slow;
	}
	if (r->inbound_port) {
		/* The proxy may already listen: the general path finds the listener and registers it. */
		if (rdr_inbound_listener_maybe(r->inbound_port, RDR_FAM4 | (c->v6 ? RDR_FAM6 : 0), &sc, r->tcp_diag))
			goto slow;
	}

	step_done(c, RDR_STEP_LISTENER);
	/* The sysctl the policy may record as ours, read before anything changes. */
	if (set->fwmark_accept) {
		fw = fwmark_accept_open(&fw_on);
		if (fw < 0)
			goto slow; /* (the general path reports it) */
		step_done(c, RDR_STEP_SYSCTL);
	}

	memset(&w, 0, sizeof(w));
	w.host = r->host;
	w.cookie = sc.cookie;
	w.netns_ino = netns_ino;
	c->pool_low = 0;
	w.pool_low = &c->pool_low;
	if (set->n_add) {
		w.add_v6 = set->add;
		w.addr_proto = r->addr_proto;
		w.addr_flags = r->addr_flags;
	}
	w.nl = s;
	w.entries = items;
	w.n_entries = (uint32_t)n;
	w.inv_base = 0; /* a fresh pod's inventory starts there */
	w.listener_fd[0] = w.listener_fd[1] = -1; /* a fresh pod has no listener: none is written */
	w.link_netns = netns_fd;
	if (set->fwmark_accept && fw_on == 0)
		policy.flags |= RDR_F_FWMARK_ACCEPT_OURS; /* (its teardown turns it off again) */
	w.policy = &policy;
	w.update_flags = BPF_NOEXIST;
	if (r->tc_forwarded) {
		ret = rdr_forwarding_on(s, tc_ifs, RDR_FWD_MAX);
		if (ret < 0)
			goto slow; /* (the general path reads them again, and says why it can't) */
		w.tc_ifs = tc_ifs;
		w.n_tc = (uint32_t)ret;
		step_done(c, RDR_STEP_FORWARDING);
	}
	w.slot_now = -1;
	w.call = c;
	w.tc_blame = &c->tc_blame;

	/* From here on, changes. First the policy routes (before the policy, as on the general path:
	 * the app's replies route back once capture is on); one of ours there already (a setup killed
	 * after them) fails the add (EEXIST): not fresh. Then the writer, which undoes its own on
	 * failure, and the routes are removed again. */
	if (set->n_routes) {
		ret = routes_add(s, set->routes, set->n_routes);
		if (ret < 0)
			goto slow; /* (undone; the general path adds them, or says why it can't) */
		routed = 1;
		step_done(c, RDR_STEP_ROUTES);
	}
	ret = rdr_ebpf_pod_write(&w);
	if (ret != 0) {
		if (routed)
			routes_undo(s, set->routes, set->n_routes, NULL);
		goto out;
	}
	/* After the policy, which recorded whether it is ours to undo: a kill in between leaves it
	 * recorded and off, which check reports and the next setup turns on. */
	if (set->fwmark_accept && fw_on != 1) {
		if (fault_here(fault_at(), 4))
			ret = RDR_POD_FAULT; /* (set up: only the sysctl is not) */
		else if (pwrite(fw, "1\n", 2, 0) < 0)
			c->err = -errno, ret = RDR_POD_FWMARK;
		step_done(c, RDR_STEP_SYSCTL);
	}
	goto out;
slow:
	ret = RDR_POD_SLOW;
out:
	if (fw >= 0)
		close(fw);
	close(s);
	/* Something of an earlier attempt was in the way (see above): not fresh. */
	return ret == -EEXIST ? RDR_POD_SLOW : ret;
}

/* Whether the initial user namespace owns the netns nsfd (its ids are the ones the programs read);
 * 0 when another does, or when it can't tell. */
static int owned_by_init_userns(int nsfd)
{
	int us = -1, ret = rdr_netns_userns(nsfd, &us);

	if (ret > 0)
		close(us);
	return ret == 0;
}

int rdr_ebpf_pod_add(const struct rdr_pod_req *r, struct rdr_pod_call *c, const char *netns_path, int netns_fd,
		     int watch_fd, int lock_fd)
{
	uint64_t wall = now_ns();
	struct stat st, hst;
	int nsfd, home, ret;

	c->step_at = wall;
	memset(c->step_ns, 0, sizeof(c->step_ns));
	memset(&c->tc_blame, 0, sizeof(c->tc_blame));

	/* A host pin was added or removed since the caller checked its objects (another process
	 * unloaded or reloaded them, say), or another thread is checking them again: the fds in r
	 * may be stale. The events stay for that check (every thread sees them until then), and
	 * it clears *alive before it reads them. */
	if (watch_fd >= 0 && rdr_watch_pending(watch_fd) != 0)
		return RDR_POD_STALE;
	if (r->host->alive && !__atomic_load_n(r->host->alive, __ATOMIC_ACQUIRE))
		return RDR_POD_STALE;
	/* The caller took these objects for the root the environment named last time; it is
	 * asked here (a getenv), not in the interpreter, where reading os.environ is several
	 * Python frames (key encoding, a mapping look-up, value decoding) on every pod's path. */
	if (r->host->root) {
		const char *root = getenv("REDIRECT_BPF_ROOT");

		if (strcmp(root && *root ? root : r->host->default_root, r->host->root) != 0)
			return RDR_POD_STALE;
	}
	if (lock_fd < 0)
		return RDR_POD_SLOW;
	/* Anything wrong with the namespace (no such file, not a netns) is for the general path
	 * to report (redirect/kernel/netns.py). Only a regular file is opened (a namespace file is
	 * one), and without blocking: a FIFO or a device named as the netns is never opened, and
	 * one swapped in meanwhile does not block the open; setns() below takes nothing but a
	 * network namespace. */
	if (netns_path) {
		if (stat(netns_path, &st) < 0 || !S_ISREG(st.st_mode))
			return RDR_POD_SLOW;
		nsfd = open(netns_path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
	} else {
		nsfd = netns_fd;
	}
	if (nsfd < 0)
		return RDR_POD_SLOW;
	if (fstat(nsfd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_ino == r->host_netns_ino[0] ||
	    st.st_ino == r->host_netns_ino[1] || (r->owner_ids && !owned_by_init_userns(nsfd))) {
		ret = RDR_POD_SLOW;
		goto out;
	}
	ret = rdr_netns_lock(lock_fd, (uint64_t)st.st_ino, 1);
	if (ret < 0) {
		ret = ret == -EAGAIN || ret == -EACCES ? RDR_POD_BUSY : RDR_POD_SLOW;
		goto out;
	}
	step_done(c, RDR_STEP_OPEN);
	home = rdr_thread_netns();
	if (home < 0) {
		ret = RDR_POD_SLOW;
	} else if (fstat(home, &hst) < 0 || (hst.st_dev == st.st_dev && hst.st_ino == st.st_ino) ||
		   setns(nsfd, CLONE_NEWNET) < 0) { /* (the caller's own netns: not a pod) */
		ret = RDR_POD_SLOW;
		close(home);
	} else {
		step_done(c, RDR_STEP_ENTER);
		ret = pod_add(r, c, nsfd, (uint64_t)st.st_ino);
		/* Coming back can only fail if the kernel is out of memory. */
		if (setns(home, CLONE_NEWNET) < 0)
			ret = RDR_POD_STRANDED;
		close(home);
	}
	rdr_netns_lock(lock_fd, (uint64_t)st.st_ino, 0);
out:
	if (netns_path)
		close(nsfd);
	step_done(c, RDR_STEP_LEAVE);
	c->wall_ns = c->step_at - wall;
	return ret;
}
