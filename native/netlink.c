/* The native files' one netlink client (netlink.h): the address scan and the ::6 address of
 * pod_setup.c, its listener look-ups over sock_diag, the tc filters and forwarding settings of
 * tc_filter.c, and the nf_tables probe of netfilter_probe.c all speak netlink through it. */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "netlink.h"

static uint32_t next_seq(uint32_t n)
{
	static uint32_t seq;

	return __atomic_add_fetch(&seq, n, __ATOMIC_RELAXED) - n + 1;
}

/* Connected to the kernel (port id 0): the kernel then refuses any other sender's datagram to
 * it (ECONNREFUSED), so whatever is read is the kernel's answer. Unconnected, any process with
 * CAP_NET_ADMIN in the netns (a pod's root) could send one to our port id and have it read as
 * an answer. */
int rdr_nl_socket(int protocol)
{
	struct sockaddr_nl kernel = {.nl_family = AF_NETLINK};
	int s = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, protocol);

	if (s < 0)
		return -errno;
	if (connect(s, (struct sockaddr *)&kernel, sizeof(kernel)) < 0) {
		int e = -errno;

		close(s);
		return e;
	}
	return s;
}

/* NLMSG_OK with the datagram's length left kept signed: NLMSG_NEXT takes the aligned length of a
 * message off it, which may leave it below zero (a last message of an unaligned length). */
static int msg_ok(const struct nlmsghdr *h, int left)
{
	return left >= (int)sizeof(*h) && h->nlmsg_len >= sizeof(*h) && h->nlmsg_len <= (unsigned)left;
}

/* An NLMSG_ERROR message's error, or -EPROTO if it is too short to hold one. */
static int msg_error(const struct nlmsghdr *h)
{
	if (h->nlmsg_len < NLMSG_LENGTH(sizeof(struct nlmsgerr)))
		return -EPROTO;
	return ((const struct nlmsgerr *)NLMSG_DATA(h))->error;
}

void *rdr_nl_start(struct rdr_nlreq *r, uint16_t type, uint16_t flags, const void *body, size_t len)
{
	memset(&r->h, 0, NLMSG_LENGTH(len)); /* (only what is sent: the rest of r stays untouched) */
	r->h.nlmsg_len = (uint32_t)NLMSG_LENGTH(len);
	r->h.nlmsg_type = type;
	r->h.nlmsg_flags = NLM_F_REQUEST | flags;
	if (body)
		memcpy(NLMSG_DATA(&r->h), body, len);
	return NLMSG_DATA(&r->h);
}

struct rtattr *rdr_nl_attr(struct rdr_nlreq *r, unsigned short type, const void *data, size_t len)
{
	size_t off = NLMSG_ALIGN(r->h.nlmsg_len);
	struct rtattr *rta = (struct rtattr *)(r->raw + off);

	if (off + RTA_SPACE(len) > sizeof(r->raw))
		return rta; /* (never: see the callers) */
	rta->rta_type = type;
	rta->rta_len = (unsigned short)RTA_LENGTH(len);
	if (data && len)
		memcpy(RTA_DATA(rta), data, len);
	r->h.nlmsg_len = (uint32_t)(off + RTA_ALIGN(rta->rta_len));
	return rta;
}

void rdr_nl_nest_end(struct rdr_nlreq *r, struct rtattr *nest)
{
	nest->rta_len = (unsigned short)(r->raw + r->h.nlmsg_len - (char *)nest);
}

int rdr_nl_recv(int s, char *buf, size_t each, int n, int *lens)
{
	struct mmsghdr m[RDR_NL_RECV_MAX];
	struct iovec iov[RDR_NL_RECV_MAX];
	int got;

	if (n > RDR_NL_RECV_MAX)
		n = RDR_NL_RECV_MAX;
	if (n < 1)
		return -EINVAL;
	memset(m, 0, sizeof(m[0]) * (size_t)n);
	for (int i = 0; i < n; i++) {
		iov[i].iov_base = buf + (size_t)i * each;
		iov[i].iov_len = each;
		m[i].msg_hdr.msg_iov = &iov[i];
		m[i].msg_hdr.msg_iovlen = 1;
	}
	do
		got = recvmmsg(s, m, (unsigned)n, MSG_WAITFORONE, NULL);
	while (got < 0 && errno == EINTR);
	if (got < 0)
		return -errno;
	for (int i = 0; i < got; i++)
		lens[i] = m[i].msg_hdr.msg_flags & MSG_TRUNC ? -EMSGSIZE : (int)m[i].msg_len;
	return got;
}

int rdr_nl_talk(int s, struct nlmsghdr *req, char *reply, size_t reply_len)
{
	char buf[8192] __attribute__((aligned(8)));

	req->nlmsg_seq = next_seq(1);
	if (!reply)
		req->nlmsg_flags |= NLM_F_ACK;
	if (send(s, req, req->nlmsg_len, 0) < 0)
		return -errno;
	for (int rounds = 0; rounds < 64; rounds++) {
		const struct nlmsghdr *h;
		int len, got = rdr_nl_recv(s, buf, sizeof(buf), 1, &len);

		if (got < 0)
			return got;
		if (len < 0)
			return len;
		for (h = (const struct nlmsghdr *)buf; msg_ok(h, len); h = NLMSG_NEXT(h, len)) {
			if (h->nlmsg_seq != req->nlmsg_seq)
				continue;
			if (h->nlmsg_type == NLMSG_ERROR)
				return msg_error(h);
			if (!reply)
				continue;
			if (h->nlmsg_len > reply_len)
				return -EMSGSIZE;
			memcpy(reply, h, h->nlmsg_len);
			return 0;
		}
	}
	return -EPROTO;
}

int rdr_nl_dump(int s, struct nlmsghdr *req, char *buf, size_t each,
		int (*on)(void *, const struct nlmsghdr *), void *arg)
{
	int lens[2], got = 0, at = 0, intr = 0;

	req->nlmsg_seq = next_seq(1);
	req->nlmsg_flags |= NLM_F_REQUEST | NLM_F_DUMP;
	if (send(s, req, req->nlmsg_len, 0) < 0)
		return -errno;
	for (int rounds = 0; rounds < 4096; rounds++, at++) {
		const struct nlmsghdr *h;
		int n, ret;

		if (at == got) { /* (a batch and the dump's end, in one call where they both came) */
			got = rdr_nl_recv(s, buf, each, 2, lens);
			if (got < 0)
				return got;
			at = 0;
		}
		n = lens[at];
		if (n < 0)
			return n;
		for (h = (const struct nlmsghdr *)(buf + (size_t)at * each); msg_ok(h, n); h = NLMSG_NEXT(h, n)) {
			if (h->nlmsg_seq != req->nlmsg_seq)
				continue;
			intr |= h->nlmsg_flags & NLM_F_DUMP_INTR;
			if (h->nlmsg_type == NLMSG_DONE)
				return intr ? -EINTR : 0;
			if (h->nlmsg_type == NLMSG_ERROR)
				return msg_error(h);
			ret = on(arg, h);
			if (ret != 0)
				return ret;
		}
	}
	return -EPROTO;
}

int rdr_nl_dump_whole(int s, struct nlmsghdr *req, char *buf, size_t each,
		      int (*on)(void *, const struct nlmsghdr *), void (*reset)(void *), void *arg)
{
	int ret = -EINTR;

	for (int i = 0; i < RDR_NL_DUMP_TRIES && ret == -EINTR; i++) {
		if (reset)
			reset(arg);
		ret = rdr_nl_dump(s, req, buf, each, on, arg);
	}
	return ret;
}

int rdr_nl_batch(int s, void *msgs, size_t len, int n, int *answers, char *buf, size_t each)
{
	uint32_t first = next_seq((uint32_t)n);
	struct nlmsghdr *m = msgs;
	size_t left = len;
	int got = 0;

	for (int i = 0; i < n; i++) {
		answers[i] = -EPROTO;
		if (!NLMSG_OK(m, left))
			return -EINVAL;
		m->nlmsg_seq = first + (uint32_t)i;
		m = NLMSG_NEXT(m, left);
	}
	if (send(s, msgs, len, 0) < 0)
		return -errno;
	/* (the answers are all there once the send returns: few calls) */
	for (int rounds = 0; rounds < 64 && got < n; rounds++) {
		int lens[RDR_NL_RECV_MAX], k = rdr_nl_recv(s, buf, each, n - got, lens);

		if (k < 0)
			return k;
		for (int j = 0; j < k; j++) {
			const struct nlmsghdr *h = (const struct nlmsghdr *)(buf + (size_t)j * each);
			int dlen = lens[j] == -EMSGSIZE ? (int)each : lens[j]; /* cut short: its start is there */
			uint32_t i;

			if (dlen < (int)sizeof(*h))
				continue;
			i = h->nlmsg_seq - first;
			if (i >= (uint32_t)n || answers[i] != -EPROTO)
				continue;
			if (h->nlmsg_type != NLMSG_ERROR)
				answers[i] = 1;
			else if (dlen >= (int)NLMSG_LENGTH(sizeof(struct nlmsgerr)))
				answers[i] = ((const struct nlmsgerr *)NLMSG_DATA(h))->error;
			else
				continue;
			got++;
		}
	}
	return got == n ? 0 : -EPROTO;
}
