/* The tc side of a pod that forwards (redirect/bpf/tc_forward.c): which of its interfaces forward, and
 * the cls_bpf filters that run the shared tc programs there.
 *
 * A filter of ours sits in the interface's clsact qdisc (made if missing) at priority
 * RDR_TC_PRIO, handle 1, protocol all, in direct-action mode, in chain 0, named after its program
 * ("rdr_tc_ingress", "rdr_tc_egress"); its classid's minor is the pod's pool slot plus one, which
 * the kernel hands the program as skb->tc_classid (16 bits: the minor alone), and its major says
 * whether the clsact qdisc is ours (QDISC_OURS: made by the send that made the filter) or not
 * (QDISC_NOT_OURS: a qdisc that was there; and every filter made before the major said so, where
 * it cannot be told). The qdisc goes with our filters only when one of them says it is ours and
 * nothing else is in it: a pod's own clsact qdisc stays, empty or not. The record lives in our
 * filters, so it lasts exactly as long as they do, and a kill anywhere leaves none that says
 * wrong: a filter says it from the moment it is made, and the qdisc goes in one request with the
 * filters. A filter not ours at our priority (of any kind or protocol, in our filter's place or
 * beside it) is in the way: setup fails naming it; it is never touched.
 *
 * Filters are not tcx links: attaching a tcx link waits for an RCU grace period (a swap of the
 * device's program array, then synchronize_rcu), which a filter's netlink request does not
 * (docs/kernel-facts.md has the figures and how to measure them). The kernel removes the qdisc and
 * its filters with the interface, and when the interface moves to another netns.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/if_arp.h>
#include <linux/if_ether.h>
#include <linux/netconf.h>
#include <linux/netlink.h>
#include <linux/pkt_cls.h>
#include <linux/pkt_sched.h>
#include <linux/rtnetlink.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "netlink.h"
#include "redirect_native.h"

#ifndef TC_H_CLSACT
#define TC_H_CLSACT TC_H_INGRESS
#endif
#ifndef TC_H_MIN_INGRESS
#define TC_H_MIN_INGRESS 0xFFF2U
#define TC_H_MIN_EGRESS 0xFFF3U
#endif

#define TC_NAME_IN "rdr_tc_ingress"
#define TC_NAME_OUT "rdr_tc_egress"

/* A filter's classid's major: whether the clsact qdisc it is in is ours (the file's comment). */
#define QDISC_NOT_OURS (1U << 16)
#define QDISC_OURS (2U << 16)

static void tc_req(struct rdr_nlreq *r, uint16_t type, uint16_t flags, int ifindex, uint32_t parent,
		   uint32_t handle, uint32_t info)
{
	struct tcmsg t = {.tcm_family = AF_UNSPEC, .tcm_ifindex = ifindex, .tcm_parent = parent, .tcm_handle = handle,
			  .tcm_info = info};

	rdr_nl_start(r, type, flags, &t, sizeof(t));
}

static uint32_t our_info(void)
{
	return TC_H_MAKE((uint32_t)RDR_TC_PRIO << 16, htons(ETH_P_ALL));
}

static uint32_t parent_of(int egress)
{
	return TC_H_MAKE(TC_H_CLSACT, egress ? TC_H_MIN_EGRESS : TC_H_MIN_INGRESS);
}

static int qdisc_ours(uint32_t classid)
{
	return TC_H_MAJ(classid) == QDISC_OURS;
}

/* rdr_nl_dump of r with a buffer of two datagrams of two pages each; with reset, rdr_nl_dump_whole
 * (a dump the kernel may flag inconsistent: tc's own dumps are not flagged, and a flagged one
 * fails with -EINTR). */
static int nl_dump(int s, struct rdr_nlreq *r, int (*each)(void *, const struct nlmsghdr *), void (*reset)(void *),
		   void *arg)
{
	char buf[2][8192] __attribute__((aligned(8)));

	if (reset)
		return rdr_nl_dump_whole(s, &r->h, buf[0], sizeof(buf[0]), each, reset, arg);
	return rdr_nl_dump(s, &r->h, buf[0], sizeof(buf[0]), each, arg);
}

/* A string attribute's value into out (cut short to size - 1 bytes, NUL-terminated). */
static void copy_str(const struct rtattr *rta, char *out, size_t size)
{
	size_t n = RTA_PAYLOAD(rta);

	if (n >= size)
		n = size - 1;
	memcpy(out, RTA_DATA(rta), n);
	out[n] = 0;
}

static int attr_str(const struct nlmsghdr *h, size_t hdr, unsigned short type, char *out, size_t size)
{
	int len = (int)h->nlmsg_len - (int)NLMSG_LENGTH(hdr);
	const struct rtattr *rta;

	for (rta = (const struct rtattr *)((const char *)NLMSG_DATA(h) + NLMSG_ALIGN(hdr)); RTA_OK(rta, len);
	     rta = RTA_NEXT(rta, len)) {
		if (rta->rta_type == type) {
			copy_str(rta, out, size);
			return 1;
		}
	}
	return 0;
}

/* One side of an interface's clsact qdisc, as a dump of its filters shows it (look). */
struct look {
	int egress;
	int ours;                  /* our filter is there */
	uint32_t prog_id, classid; /* its program and classid */
	int beside;                /* a filter not ours at our priority in chain 0 (in our filter's place
				    * or beside it) */
	uint32_t handle;           /* the first such filter's handle */
	uint16_t protocol;         /* the protocol and kind at our priority in chain 0 (its filters share them) */
	char kind[16];
	int elsewhere;             /* a filter at another priority or in another chain (a whole look) */
};

static int on_look(void *arg, const struct nlmsghdr *h)
{
	struct look *l = arg;
	const struct tcmsg *t = NLMSG_DATA(h);
	const char *want = l->egress ? TC_NAME_OUT : TC_NAME_IN;
	const struct rtattr *rta;
	uint32_t chain = 0, id = 0, cid = 0;
	char kind[16] = "";
	int len, named = 0;

	if (h->nlmsg_type != RTM_NEWTFILTER || h->nlmsg_len < NLMSG_LENGTH(sizeof(*t)))
		return 0;
	len = (int)h->nlmsg_len - NLMSG_LENGTH(sizeof(*t));
	for (rta = (const struct rtattr *)((const char *)t + NLMSG_ALIGN(sizeof(*t))); RTA_OK(rta, len);
	     rta = RTA_NEXT(rta, len)) {
		const struct rtattr *o;
		int olen;

		switch (rta->rta_type & ~NLA_F_NESTED) {
		case TCA_CHAIN:
			if (RTA_PAYLOAD(rta) >= 4)
				memcpy(&chain, RTA_DATA(rta), 4);
			break;
		case TCA_KIND:
			copy_str(rta, kind, sizeof(kind));
			break;
		case TCA_OPTIONS:
			olen = (int)RTA_PAYLOAD(rta);
			for (o = RTA_DATA(rta); RTA_OK(o, olen); o = RTA_NEXT(o, olen)) {
				if (o->rta_type == TCA_BPF_ID && RTA_PAYLOAD(o) >= 4)
					memcpy(&id, RTA_DATA(o), 4);
				else if (o->rta_type == TCA_BPF_CLASSID && RTA_PAYLOAD(o) >= 4)
					memcpy(&cid, RTA_DATA(o), 4);
				else if (o->rta_type == TCA_BPF_NAME)
					named = RTA_PAYLOAD(o) >= strlen(want) + 1 &&
						strncmp(RTA_DATA(o), want, strlen(want) + 1) == 0;
			}
			break;
		}
	}
	if (chain != 0 || TC_H_MAJ(t->tcm_info) != (uint32_t)RDR_TC_PRIO << 16) {
		l->elsewhere = 1;
		return 0;
	}
	if (!l->kind[0]) {
		memcpy(l->kind, kind, sizeof(l->kind));
		l->protocol = ntohs((uint16_t)TC_H_MIN(t->tcm_info));
	}
	if (t->tcm_handle == 0) /* (the priority's own entry: its kind and protocol) */
		return 0;
	if (t->tcm_handle == 1 && named && strcmp(kind, "bpf") == 0) {
		l->ours = 1;
		l->prog_id = id;
		l->classid = cid;
	} else if (!l->beside) {
		l->beside = 1;
		l->handle = t->tcm_handle;
	}
	return 0;
}

/* One side of the interface's clsact qdisc: what is at our priority in chain 0 (whole: and whether
 * anything is elsewhere), in *l (nothing there when there is no qdisc). 0, or -errno. */
static int look(int s, int ifindex, int egress, int whole, struct look *l)
{
	struct rdr_nlreq r;
	uint32_t chain = 0;
	int ret;

	memset(l, 0, sizeof(*l));
	l->egress = egress;
	tc_req(&r, RTM_GETTFILTER, 0, ifindex, parent_of(egress), 0,
	       whole ? 0 : TC_H_MAKE((uint32_t)RDR_TC_PRIO << 16, 0));
	if (!whole)
		rdr_nl_attr(&r, TCA_CHAIN, &chain, 4);
	ret = nl_dump(s, &r, on_look, NULL, l);
	return ret == -EINVAL || ret == -ENOENT || ret == -ENODEV ? 0 : ret; /* (no qdisc, or no interface) */
}

static int on_chain(void *arg, const struct nlmsghdr *h)
{
	const struct rtattr *rta;
	int len;

	if (h->nlmsg_type != RTM_NEWCHAIN || h->nlmsg_len < NLMSG_LENGTH(sizeof(struct tcmsg)))
		return 0;
	len = (int)h->nlmsg_len - NLMSG_LENGTH(sizeof(struct tcmsg));
	for (rta = (const struct rtattr *)((const char *)NLMSG_DATA(h) + NLMSG_ALIGN(sizeof(struct tcmsg)));
	     RTA_OK(rta, len); rta = RTA_NEXT(rta, len)) {
		uint32_t idx = 0;

		if (rta->rta_type == TCA_KIND) /* (a template) */
			*(int *)arg = 1;
		if (rta->rta_type == TCA_CHAIN && RTA_PAYLOAD(rta) >= 4) {
			memcpy(&idx, RTA_DATA(rta), 4);
			if (idx != 0)
				*(int *)arg = 1;
		}
	}
	return 0;
}

/* Whether the interface's clsact qdisc holds anything not ours, its sides as a whole look shows
 * them (l): a filter (ours: at our priority, handle 1, by name), or a chain someone made (one but
 * chain 0, or chain 0 with a template). 0 only when it holds nothing else (1 when that cannot be
 * read: what cannot be read is not taken). */
static int holds_others_in(int s, int ifindex, const struct look l[2])
{
	for (int side = 0; side < 2; side++) {
		struct rdr_nlreq r;
		int chains = 0, ret;

		if (l[side].beside || l[side].elsewhere)
			return 1;
		tc_req(&r, RTM_GETCHAIN, 0, ifindex, parent_of(side), 0, 0);
		ret = nl_dump(s, &r, on_chain, NULL, &chains);
		if ((ret < 0 && ret != -EINVAL && ret != -ENOENT) || chains)
			return 1;
	}
	return 0;
}

/* holds_others_in, with a whole look of each side taken here. */
static int holds_others(int s, int ifindex)
{
	struct look l[2];

	for (int side = 0; side < 2; side++)
		if (look(s, ifindex, side, 1, &l[side]) < 0)
			return 1;
	return holds_others_in(s, ifindex, l);
}

/* The interface's clsact qdisc, and whatever is in it: 0 (gone, or not there), or -errno. */
static int del_qdisc(int s, int ifindex)
{
	struct rdr_nlreq r;
	int ret;

	tc_req(&r, RTM_DELQDISC, 0, ifindex, TC_H_CLSACT, TC_H_MAKE(TC_H_CLSACT, 0), 0);
	rdr_nl_attr(&r, TCA_KIND, "clsact", 7);
	ret = rdr_nl_talk(s, &r.h, NULL, 0);
	return ret == -ENOENT || ret == -EINVAL ? 0 : ret;
}

/* A request for our filter on one side, with classid (its major included). */
static void filter_req(struct rdr_nlreq *r, uint16_t flags, int ifindex, int egress, int prog_fd, uint32_t classid)
{
	const char *name = egress ? TC_NAME_OUT : TC_NAME_IN;
	uint32_t fd = (uint32_t)prog_fd, bpf_flags = TCA_BPF_FLAG_ACT_DIRECT;
	struct rtattr *opts;

	tc_req(r, RTM_NEWTFILTER, NLM_F_CREATE | flags, ifindex, parent_of(egress), 1, our_info());
	rdr_nl_attr(r, TCA_KIND, "bpf", 4);
	opts = rdr_nl_attr(r, TCA_OPTIONS, NULL, 0);
	rdr_nl_attr(r, TCA_BPF_FD, &fd, 4);
	rdr_nl_attr(r, TCA_BPF_NAME, name, strlen(name) + 1);
	rdr_nl_attr(r, TCA_BPF_FLAGS, &bpf_flags, 4);
	rdr_nl_attr(r, TCA_BPF_CLASSID, &classid, 4);
	rdr_nl_nest_end(r, opts);
}

/* Our filter on one side, where one of ours is, alone at our priority (another's there or beside
 * it: -EEXIST, left alone): replaced, with classid's minor and its own major (whether the qdisc is
 * ours does not change), its program held open (*old_fd, -1 if it is gone already) and its classid
 * kept (*old_cid) for an undo. */
static int replace_filter(int s, int ifindex, int egress, int prog_fd, uint32_t classid, int *old_fd,
			  uint32_t *old_cid)
{
	struct rdr_nlreq r;
	struct look l;
	int ret = look(s, ifindex, egress, 0, &l);

	if (ret < 0)
		return ret;
	if (l.beside)
		return -EEXIST;
	if (!l.ours) /* (gone since the add found it) */
		return -EAGAIN;
	*old_fd = l.prog_id ? rdr_bpf_prog_get_fd_by_id(l.prog_id) : -1;
	if (*old_fd < 0)
		*old_fd = -1;
	*old_cid = l.classid;
	filter_req(&r, 0, ifindex, egress, prog_fd,
		   TC_H_MAKE(qdisc_ours(l.classid) ? QDISC_OURS : QDISC_NOT_OURS, classid));
	ret = rdr_nl_talk(s, &r.h, NULL, 0);
	if (ret < 0 && *old_fd >= 0) {
		close(*old_fd);
		*old_fd = -1;
	}
	return ret;
}

/* Our filter off one side (the caller knows it is ours): 0 (gone, or not there), or -errno. */
static int del_ours(int s, int ifindex, int egress)
{
	struct rdr_nlreq r;
	int ret;

	tc_req(&r, RTM_DELTFILTER, 0, ifindex, parent_of(egress), 1, our_info());
	rdr_nl_attr(&r, TCA_KIND, "bpf", 4);
	ret = rdr_nl_talk(s, &r.h, NULL, 0);
	return ret == -ENOENT || ret == -EINVAL ? 0 : ret;
}

/* An ack (the error and the request again) of one of our requests, rounded up to 8 bytes. */
#define ACK_MAX ((NLMSG_LENGTH(sizeof(struct nlmsgerr)) + sizeof(struct rdr_nlreq) + 256 + 7) & ~(size_t)7)
#define BATCH_MAX 5

/* The requests in one send, each acked: the answers (0 or -errno) in order. */
static int nl_batch(int s, struct rdr_nlreq *reqs, int n, int *answers)
{
	char out[BATCH_MAX * sizeof(struct rdr_nlreq)] __attribute__((aligned(8)));
	char buf[BATCH_MAX][ACK_MAX] __attribute__((aligned(8)));
	size_t len = 0;

	if (n > BATCH_MAX)
		return -EINVAL;
	for (int i = 0; i < n; i++) {
		reqs[i].h.nlmsg_flags |= NLM_F_ACK;
		memcpy(out + len, &reqs[i], reqs[i].h.nlmsg_len);
		len += NLMSG_ALIGN(reqs[i].h.nlmsg_len);
	}
	return rdr_nl_batch(s, out, len, n, answers, buf[0], sizeof(buf[0]));
}

static int on_ingress_qdisc(void *arg, const struct nlmsghdr *h)
{
	struct rdr_tc_blame *b = arg;
	const struct tcmsg *t = NLMSG_DATA(h);

	if (h->nlmsg_type != RTM_NEWQDISC || h->nlmsg_len < NLMSG_LENGTH(sizeof(struct tcmsg)) ||
	    t->tcm_ifindex != b->ifindex || t->tcm_parent != TC_H_CLSACT)
		return 0;
	if (attr_str(h, sizeof(struct tcmsg), TCA_KIND, b->kind, sizeof(b->kind)) && strcmp(b->kind, "clsact") != 0)
		b->what = RDR_TC_BLAME_QDISC;
	return 0; /* (read to the end) */
}

extern char *if_indextoname(unsigned int ifindex, char *ifname); /* (<net/if.h> clashes with <linux/if.h>) */

/* What holds our place on one side of the interface, where putting our filter there failed with
 * err (EEXIST: a filter at our priority and handle that is not ours, or one beside ours; EINVAL:
 * one of another kind or protocol at our priority, or no clsact qdisc): in b, and -EEXIST; else
 * err. Only looked at on failure: another qdisc where the clsact qdisc goes (an ingress qdisc,
 * whose one block takes the filters of both sides), else a filter not ours at our priority on
 * that side (its handle, or 0 when only the priority's kind and protocol are known). */
static int blame(int s, int ifindex, int egress, int err, struct rdr_tc_blame *b)
{
	struct rdr_tc_blame found;
	struct rdr_nlreq r;
	struct look l;

	memset(&found, 0, sizeof(found));
	found.ifindex = ifindex;
	tc_req(&r, RTM_GETQDISC, 0, 0, 0, 0, 0); /* (a get of it went unanswered on 6.18: the dump) */
	nl_dump(s, &r, on_ingress_qdisc, NULL, &found);
	if (!found.what && look(s, ifindex, egress, 0, &l) == 0 && (l.beside || (l.kind[0] && !l.ours))) {
		memset(&found, 0, sizeof(found));
		found.what = RDR_TC_BLAME_FILTER;
		found.egress = egress;
		found.protocol = l.protocol;
		found.handle = l.beside ? l.handle : 0;
		memcpy(found.kind, l.kind, sizeof(found.kind));
	}
	if (!found.what)
		return err;
	found.ifindex = ifindex;
	if (if_indextoname((unsigned int)ifindex, found.ifname) == NULL)
		found.ifname[0] = 0;
	if (b)
		*b = found;
	return -EEXIST;
}

void rdr_tc_keep(struct rdr_tc_made *m)
{
	for (int side = 0; side < 2; side++) {
		if (m->old_fd[side] >= 0)
			close(m->old_fd[side]);
		m->old_fd[side] = -1;
	}
}

static void undo_on(int s, struct rdr_tc_made *m)
{
	for (int side = 0; side < 2; side++) {
		if (m->side[side] == 2 && m->old_fd[side] >= 0) { /* ours from before, put back */
			struct rdr_nlreq r;

			filter_req(&r, 0, m->ifindex, side, m->old_fd[side], m->old_classid[side]);
			if (rdr_nl_talk(s, &r.h, NULL, 0) == 0)
				continue;
		}
		if (m->side[side]) /* made here (or not to be put back: its program is gone) */
			del_ours(s, m->ifindex, side);
	}
	if (m->qdisc && !holds_others(s, m->ifindex))
		del_qdisc(s, m->ifindex);
	rdr_tc_keep(m);
	memset(m->side, 0, sizeof(m->side));
	m->qdisc = 0;
}

void rdr_tc_undo(struct rdr_tc_made *m)
{
	int s = rdr_nl_socket(NETLINK_ROUTE);

	if (s < 0) { /* (no socket: nothing can be taken back) */
		rdr_tc_keep(m);
		return;
	}
	undo_on(s, m);
	close(s);
}


/* Where the IP header of the interface's packets starts, as the tc programs see them: 0 behind an
 * Ethernet header (Ethernet, loopback), RDR_TC_NO_L2 when there is none (tun, IP tunnels), else
 * -EPFNOSUPPORT (a link type whose header the programs cannot step over), described in *b. */
static int link_l2(int s, int ifindex, struct rdr_tc_blame *b)
{
	struct ifinfomsg ifi = {.ifi_family = AF_UNSPEC, .ifi_index = ifindex};
	struct rdr_nlreq r;
	char reply[8192] __attribute__((aligned(8)));
	const struct nlmsghdr *h = (const struct nlmsghdr *)reply;
	int ret;

	rdr_nl_start(&r, RTM_GETLINK, 0, &ifi, sizeof(ifi));
	ret = rdr_nl_talk(s, &r.h, reply, sizeof(reply));
	if (ret < 0)
		return ret;
	if (h->nlmsg_type != RTM_NEWLINK || h->nlmsg_len < NLMSG_LENGTH(sizeof(ifi)))
		return -EPROTO;
	switch (((const struct ifinfomsg *)NLMSG_DATA(h))->ifi_type) {
	case ARPHRD_ETHER:
	case ARPHRD_LOOPBACK:
		return 0;
	case ARPHRD_NONE:
	case ARPHRD_RAWIP:
	case ARPHRD_TUNNEL:
	case ARPHRD_TUNNEL6:
	case ARPHRD_SIT:
	case ARPHRD_IPGRE:
	case ARPHRD_IP6GRE:
		return RDR_TC_NO_L2;
	}
	if (b) {
		memset(b, 0, sizeof(*b));
		b->ifindex = ifindex;
		b->what = RDR_TC_BLAME_LINK;
		b->protocol = ((const struct ifinfomsg *)NLMSG_DATA(h))->ifi_type;
		if (if_indextoname((unsigned int)ifindex, b->ifname) == NULL)
			b->ifname[0] = 0;
	}
	return -EPFNOSUPPORT;
}

int rdr_tc_attach(int ifindex, int prog_in, int prog_out, uint32_t classid, struct rdr_tc_made *m,
		  struct rdr_tc_blame *b)
{
	struct rdr_nlreq reqs[5];
	int s = rdr_nl_socket(NETLINK_ROUTE), ret, ans[5];

	memset(m, 0, sizeof(*m));
	m->ifindex = ifindex;
	m->old_fd[0] = m->old_fd[1] = -1;
	if (s < 0)
		return s;
	ret = link_l2(s, ifindex, b);
	if (ret < 0)
		goto out;
	classid |= (uint32_t)ret;
	/* In one send: each filter before the qdisc, made only in a clsact qdisc that was there (it
	 * says so: QDISC_NOT_OURS); the qdisc, made unless there; each filter again, made only where
	 * the first failed, which it does where there was no qdisc, and then the qdisc was made here
	 * (it says so: QDISC_OURS). A place taken, by ours or another's, is looked at below. */
	filter_req(&reqs[0], NLM_F_EXCL, ifindex, 0, prog_in, TC_H_MAKE(QDISC_NOT_OURS, classid));
	filter_req(&reqs[1], NLM_F_EXCL, ifindex, 1, prog_out, TC_H_MAKE(QDISC_NOT_OURS, classid));
	tc_req(&reqs[2], RTM_NEWQDISC, NLM_F_CREATE | NLM_F_EXCL, ifindex, TC_H_CLSACT, TC_H_MAKE(TC_H_CLSACT, 0), 0);
	rdr_nl_attr(&reqs[2], TCA_KIND, "clsact", 7);
	filter_req(&reqs[3], NLM_F_EXCL, ifindex, 0, prog_in, TC_H_MAKE(QDISC_OURS, classid));
	filter_req(&reqs[4], NLM_F_EXCL, ifindex, 1, prog_out, TC_H_MAKE(QDISC_OURS, classid));
	ret = nl_batch(s, reqs, 5, ans);
	m->qdisc = ans[2] == 0; /* (what was made is undone, whatever else failed) */
	for (int side = 0; side < 2; side++)
		if (ans[side] == 0 || ans[3 + side] == 0)
			m->side[side] = 1;
	if (ret == 0)
		ret = ans[2] == -EEXIST ? 0 : ans[2];
	for (int side = 0; side < 2 && ret == 0; side++) {
		struct look l;

		if (ans[side] == 0) { /* made in a qdisc that was there: alone at our priority? */
			ret = look(s, ifindex, side, 0, &l);
			if (ret == 0 && l.beside)
				ret = -EEXIST;
		} else if (ans[3 + side] == 0) {
			/* (made saying the qdisc is ours: true unless another made it between the two) */
			ret = m->qdisc ? 0 : -EAGAIN;
		} else {
			ret = ans[3 + side];
			if (ret == -EEXIST) {
				ret = replace_filter(s, ifindex, side, side ? prog_out : prog_in, classid,
						     &m->old_fd[side], &m->old_classid[side]);
				if (ret == 0)
					m->side[side] = 2;
			}
		}
		if (ret == -EEXIST || ret == -EINVAL)
			ret = blame(s, ifindex, side, ret, b);
	}
	if (ret < 0) /* undone: what this call made, and ours it replaced put back */
		undo_on(s, m);
out:
	close(s);
	return ret;
}

/* Our filters off the interface: with the clsact qdisc, in one request, when one of them says the
 * qdisc is ours and it holds nothing else; else each alone (the qdisc stays). 1 (ours were there),
 * 0 (none of ours), or -errno. */
static int detach_on(int s, int ifindex)
{
	struct look l[2];
	int ret, mine = 0;

	for (int side = 0; side < 2; side++) { /* (whole: what else the qdisc holds is seen in the same dump) */
		ret = look(s, ifindex, side, 1, &l[side]);
		if (ret < 0)
			return ret;
		mine |= l[side].ours && qdisc_ours(l[side].classid);
	}
	if (!l[0].ours && !l[1].ours)
		return 0;
	if (mine && !holds_others_in(s, ifindex, l)) {
		ret = del_qdisc(s, ifindex);
		return ret < 0 ? ret : 1;
	}
	for (int side = 0; side < 2; side++) {
		ret = l[side].ours ? del_ours(s, ifindex, side) : 0;
		if (ret < 0)
			return ret;
	}
	return 1;
}

int rdr_tc_detach(int ifindex)
{
	int s = rdr_nl_socket(NETLINK_ROUTE), ret;

	if (s < 0)
		return s;
	ret = detach_on(s, ifindex);
	close(s);
	return ret < 0 ? ret : 0;
}

/* The interfaces of the calling thread's netns with a clsact qdisc, as many as there are (a pod makes
 * as many as it likes: the list grows, up to IDX_MAX). */
#define IDX_MAX (1 << 20)

struct idx_list {
	int *idx;
	int n, cap;
};

static int on_qdisc(void *arg, const struct nlmsghdr *h)
{
	struct idx_list *l = arg;
	const struct tcmsg *t = NLMSG_DATA(h);
	const struct rtattr *rta;
	int alen;

	if (h->nlmsg_type != RTM_NEWQDISC || t->tcm_ifindex <= 1)
		return 0;
	alen = (int)h->nlmsg_len - NLMSG_LENGTH(sizeof(struct tcmsg));
	for (rta = (const struct rtattr *)((const char *)t + NLMSG_ALIGN(sizeof(struct tcmsg))); RTA_OK(rta, alen);
	     rta = RTA_NEXT(rta, alen)) {
		if (rta->rta_type != TCA_KIND || strncmp(RTA_DATA(rta), "clsact", RTA_PAYLOAD(rta)) != 0)
			continue;
		if (l->n == l->cap) {
			int cap = l->cap ? 2 * l->cap : 64, *idx;

			if (cap > IDX_MAX)
				return -E2BIG;
			idx = realloc(l->idx, (size_t)cap * sizeof(*idx));
			if (idx == NULL)
				return -ENOMEM;
			l->idx = idx;
			l->cap = cap;
		}
		l->idx[l->n++] = t->tcm_ifindex;
	}
	return 0;
}

/* The interfaces with a clsact qdisc (one RTM_GETQDISC dump) in l (l->idx to free), or -errno. */
static int clsact_interfaces(int s, struct idx_list *l)
{
	struct rdr_nlreq r;
	int ret;

	memset(l, 0, sizeof(*l));
	tc_req(&r, RTM_GETQDISC, 0, 0, 0, 0, 0);
	ret = nl_dump(s, &r, on_qdisc, NULL, l);
	return ret < 0 ? ret : 0;
}

/* Our filters in the calling thread's netns (on the interfaces with a clsact qdisc), a side without
 * ours with program 0: how many interfaces have ours (the first max of them written to out), or
 * -errno. */
static int list_ours(int s, struct rdr_tc_filter *out, int max)
{
	struct idx_list l;
	int ret = clsact_interfaces(s, &l), found = 0;

	for (int i = 0; ret == 0 && i < l.n; i++) {
		struct rdr_tc_filter f = {.ifindex = l.idx[i]};
		struct look in, eg;

		if (look(s, l.idx[i], 0, 0, &in) < 0)
			memset(&in, 0, sizeof(in));
		if (look(s, l.idx[i], 1, 0, &eg) < 0)
			memset(&eg, 0, sizeof(eg));
		if (!in.ours && !eg.ours)
			continue;
		if (in.ours) {
			f.prog_in = in.prog_id;
			f.classid_in = in.classid;
		}
		if (eg.ours) {
			f.prog_out = eg.prog_id;
			f.classid_out = eg.classid;
		}
		f.others = (in.beside ? 1U : 0U) | (eg.beside ? 2U : 0U);
		if (found < max)
			out[found] = f;
		found++;
	}
	free(l.idx);
	return ret < 0 ? ret : found;
}

int rdr_tc_list(struct rdr_tc_filter *out, int max)
{
	int s = rdr_nl_socket(NETLINK_ROUTE), ret;

	if (s < 0)
		return s;
	ret = list_ours(s, out, max);
	close(s);
	return ret;
}

int rdr_tc_detach_all(void)
{
	struct idx_list l;
	int s = rdr_nl_socket(NETLINK_ROUTE), ret, n = 0;

	if (s < 0)
		return s;
	ret = clsact_interfaces(s, &l);
	for (int i = 0; ret == 0 && i < l.n; i++) {
		ret = detach_on(s, l.idx[i]);
		n += ret > 0;
		ret = ret < 0 ? ret : 0;
	}
	free(l.idx);
	close(s);
	return ret < 0 ? ret : n;
}

struct netconf_cb {
	void (*on)(void *, int, int, int);
	void (*reset)(void *);
	void *arg;
};

static void netconf_reset(void *arg)
{
	const struct netconf_cb *cb = arg;

	cb->reset(cb->arg);
}

static int on_netconf(void *arg, const struct nlmsghdr *h)
{
	const struct netconf_cb *cb = arg;
	const struct rtattr *rta;
	int alen, idx = 0, fwd = -1, have_idx = 0, family;

	if (h->nlmsg_type != RTM_NEWNETCONF)
		return 0;
	family = ((const struct netconfmsg *)NLMSG_DATA(h))->ncm_family;
	if (family != AF_INET && family != AF_INET6)
		return 0;
	alen = (int)h->nlmsg_len - NLMSG_LENGTH(sizeof(struct netconfmsg));
	for (rta = (const struct rtattr *)((const char *)NLMSG_DATA(h) + NLMSG_ALIGN(sizeof(struct netconfmsg)));
	     RTA_OK(rta, alen); rta = RTA_NEXT(rta, alen)) {
		if (rta->rta_type == NETCONFA_IFINDEX && RTA_PAYLOAD(rta) >= 4) {
			memcpy(&idx, RTA_DATA(rta), 4);
			have_idx = 1;
		} else if (rta->rta_type == NETCONFA_FORWARDING && RTA_PAYLOAD(rta) >= 4) {
			memcpy(&fwd, RTA_DATA(rta), 4);
		}
	}
	if (have_idx && fwd >= 0)
		cb->on(cb->arg, family, idx, fwd);
	return 0;
}

/* One RTM_GETNETCONF dump of every family: each IPv4 and IPv6 entry's family, ifindex and
 * forwarding value go to on(); made again, reset(arg) first, while the kernel flags it
 * inconsistent (rdr_nl_dump_whole). */
static int netconf_dump(int s, void (*on)(void *, int, int, int), void (*reset)(void *), void *arg)
{
	struct netconf_cb cb = {.on = on, .reset = reset, .arg = arg};
	struct netconfmsg nc = {.ncm_family = AF_UNSPEC};
	struct rdr_nlreq r;

	rdr_nl_start(&r, RTM_GETNETCONF, 0, &nc, sizeof(nc));
	return nl_dump(s, &r, on_netconf, netconf_reset, &cb);
}

struct fwd_acc {
	int *out;
	int max, n, over, v6_all;
	int v6_dev[RDR_FWD_MAX]; /* every device's IPv6 entry: they forward if all.forwarding is on */
	int n6, v6_over;         /* (more than that: an overflow only then) */
};

static void add_dev(struct fwd_acc *a, int idx)
{
	for (int i = 0; i < a->n; i++)
		if (a->out[i] == idx)
			return;
	if (a->n < a->max)
		a->out[a->n++] = idx;
	else
		a->over = 1;
}

/* IPv4 forwards what arrives on a device whose own forwarding is on; IPv6 when all.forwarding is
 * on, whatever the device. */
static void on_forwarding(void *arg, int family, int idx, int fwd)
{
	struct fwd_acc *a = arg;

	if (family == AF_INET) {
		if (idx > 1 && fwd) /* a device's (1: lo; negative: all, default) */
			add_dev(a, idx);
	} else if (idx == NETCONFA_IFINDEX_ALL) {
		a->v6_all = fwd != 0;
	} else if (idx > 1 && a->n6 < RDR_FWD_MAX) {
		a->v6_dev[a->n6++] = idx;
	} else if (idx > 1) {
		a->v6_over = 1;
	}
}

/* Before each dump: nothing found yet. */
static void fwd_reset(void *arg)
{
	struct fwd_acc *a = arg;
	int *out = a->out, max = a->max;

	memset(a, 0, sizeof(*a));
	a->out = out;
	a->max = max;
}

int rdr_forwarding_on(int s, int *ifindexes, int max)
{
	struct fwd_acc a = {.out = ifindexes, .max = max < RDR_FWD_MAX ? max : RDR_FWD_MAX};
	int ret = netconf_dump(s, on_forwarding, fwd_reset, &a);

	if (ret < 0)
		return ret;
	if (a.v6_all) { /* (all.forwarding comes after the devices in the dump) */
		for (int i = 0; i < a.n6; i++)
			add_dev(&a, a.v6_dev[i]);
		a.over |= a.v6_over;
	}
	return a.over ? -E2BIG : a.n;
}

int rdr_forwarding(int *ifindexes, int max)
{
	int s = rdr_nl_socket(NETLINK_ROUTE), ret;

	if (s < 0)
		return s;
	ret = rdr_forwarding_on(s, ifindexes, max);
	close(s);
	return ret;
}
