/* Whether the calling thread's netns has any netfilter table, in a few syscalls and without
 * creating one: what tells a namespace that may hold netfilter capture of ours (either
 * netfilter backend, either iptables variant) from one that surely holds none. Asked by the
 * eBPF backend's fresh-pod call before it sets a pod up (a pod with netfilter capture is for
 * the general path, which replaces it), and by redirect.setup before it looks for another
 * backend's capture in detail.
 *
 * nf_tables (the nftables backend and iptables-nft): one NFT_MSG_GETTABLE dump over
 * nfnetlink. Legacy x_tables (iptables-legacy): the netns's /proc/net/ip_tables_names, which
 * lists the IPv4 tables instantiated there (asking x_tables itself, IPT_SO_GET_INFO, would
 * instantiate the table it names). IPv4's alone: every install of the iptables backend writes
 * IPv4 rules, and a legacy table, once instantiated, stays until the netns goes; the IPv6
 * file would cost as much again (a procfs path walk is most of this call's time).
 *
 * Also one nf_tables table or chain as the kernel describes it (rdr_nft_table, rdr_nft_chain: a
 * get, and for a chain a dump of its rules stopped at the first): what iptables-nft's setup and
 * teardown read of the tables and built-in chains our jumps are in, without libnftables printing
 * iptables-nft's rules as text (libxtables then writes warnings to the process's stderr) or a
 * table object as JSON (unsafe in libnftables 1.0.6: docs/kernel-facts.md).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/netfilter/nf_tables.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter.h>
#include <linux/netlink.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "netlink.h"
#include "redirect_native.h"

static int on_table(void *arg, const struct nlmsghdr *h)
{
	(void)arg;
	return h->nlmsg_type == ((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE); /* one is enough */
}

/* 1 if nf_tables has a table here, 0 if none (or no nf_tables in this kernel), -errno. */
static int nft_tables(void)
{
	struct nfgenmsg g = {.nfgen_family = AF_UNSPEC, .version = NFNETLINK_V0};
	struct rdr_nlreq req;
	char buf[2][4096] __attribute__((aligned(8)));
	int s, ret;

	s = rdr_nl_socket(NETLINK_NETFILTER);
	if (s < 0)
		return s == -EPROTONOSUPPORT || s == -EAFNOSUPPORT ? 0 : s;
	rdr_nl_start(&req, (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE, 0, &g, sizeof(g));
	ret = rdr_nl_dump_whole(s, &req.h, buf[0], sizeof(buf[0]), on_table, NULL, NULL);
	close(s);
	/* No nf_tables subsystem: no tables. */
	return ret == -EOPNOTSUPP || ret == -ENOENT || ret == -EPROTONOSUPPORT ? 0 : ret;
}

/* 1 if the proc file lists a table, 0 if it is empty or absent, -errno. */
static int xt_tables(const char *path)
{
	char b[64];
	ssize_t n;
	int fd = open(path, O_RDONLY | O_CLOEXEC);

	if (fd < 0)
		return errno == ENOENT ? 0 : -errno;
	n = read(fd, b, sizeof(b));
	close(fd);
	return n < 0 ? -errno : n > 0;
}

int rdr_netfilter_present(void)
{
	int ret = nft_tables();

	return ret != 0 ? ret : xt_tables("/proc/thread-self/net/ip_tables_names");
}

/* --- one table or chain, as iptables-nft's setup and teardown read them ------------------- */

#define NFT_MSG(m) ((NFNL_SUBSYS_NFTABLES << 8) | (m))
#define REPLY_MAX 32768 /* a netlink datagram of nf_tables is never larger (SKB_WITH_OVERHEAD(32768)) */

static int nfproto(int family)
{
	return family == 4 ? NFPROTO_IPV4 : family == 6 ? NFPROTO_IPV6 : -1;
}

/* A request for family (4, 6) naming a table (attribute tattr) and, if cattr, a chain: -errno if
 * a name is too long to fit (an nf_tables name is at most 255 bytes; the request holds less). */
static int obj_request(struct rdr_nlreq *req, int msg, uint16_t flags, int family, unsigned short tattr,
		       const char *table, unsigned short cattr, const char *chain)
{
	struct nfgenmsg g = {.version = NFNETLINK_V0};
	size_t tl, cl = 0, need;

	if (nfproto(family) < 0 || !table || (cattr && !chain))
		return -EINVAL;
	g.nfgen_family = (uint8_t)nfproto(family);
	tl = strnlen(table, RDR_NLREQ_MAX);
	if (cattr)
		cl = strnlen(chain, RDR_NLREQ_MAX);
	need = NLMSG_LENGTH(sizeof(g)) + RTA_SPACE(tl + 1) + (cattr ? RTA_SPACE(cl + 1) : 0);
	if (tl == 0 || (cattr && cl == 0))
		return -EINVAL;
	if (need > RDR_NLREQ_MAX)
		return -ENAMETOOLONG;
	rdr_nl_start(req, (uint16_t)NFT_MSG(msg), flags, &g, sizeof(g));
	rdr_nl_attr(req, tattr, table, tl + 1);
	if (cattr)
		rdr_nl_attr(req, cattr, chain, cl + 1);
	return 0;
}

/* A u32 attribute (network order) as an int64, or -1 if it is not 4 bytes. */
static int64_t attr_u32(const struct rtattr *rta)
{
	uint32_t v;

	if (RTA_PAYLOAD(rta) != sizeof(v))
		return -1;
	memcpy(&v, RTA_DATA(rta), sizeof(v));
	return (int64_t)ntohl(v);
}

/* The comment in libnftnl's user data (TLVs of a type byte, a length byte, the value): the last
 * TLV of type 0 (NFTNL_UDATA_TABLE_COMMENT, NFTNL_UDATA_CHAIN_COMMENT), which nft takes only when
 * its value ends in a NUL, and as a C string. Malformed data (a TLV past its end) has none, as
 * for nft, which then prints no comment. */
static void udata_comment(const struct rtattr *rta, struct rdr_nft_obj *out)
{
	const uint8_t *p = RTA_DATA(rta);
	size_t len = RTA_PAYLOAD(rta), at = 0;
	int found = -1;
	size_t flen = 0;

	while (at < len) {
		size_t vl;

		if (len - at < 2 || (vl = p[at + 1]) > len - at - 2)
			return; /* malformed */
		if (p[at] == 0) {
			if (vl == 0 || p[at + 2 + vl - 1] != 0)
				return; /* (nft refuses all of it) */
			found = (int)(at + 2);
			flen = vl;
		}
		at += 2 + vl;
	}
	if (found < 0)
		return;
	flen = strnlen((const char *)p + found, flen);
	if (flen >= sizeof(out->comment))
		return; /* (never: the kernel keeps at most 256 bytes of user data) */
	memcpy(out->comment, p + found, flen);
	out->comment[flen] = 0;
	out->comment_len = (int)flen;
}

static void obj_clear(struct rdr_nft_obj *out)
{
	memset(out, 0, sizeof(*out));
	out->flags = out->use = out->policy = -1;
	out->comment_len = -1;
}

/* A get of the table or chain the request names: its reply's attributes into out. */
static int obj_get(struct rdr_nlreq *req, int msg, struct rdr_nft_obj *out)
{
	char *reply = malloc(REPLY_MAX);
	const struct nlmsghdr *h = (const struct nlmsghdr *)reply;
	const struct rtattr *rta;
	int s, ret, len;

	if (!reply)
		return -ENOMEM;
	s = rdr_nl_socket(NETLINK_NETFILTER);
	if (s < 0) {
		free(reply);
		return s == -EPROTONOSUPPORT || s == -EAFNOSUPPORT ? -ENOENT : s;
	}
	ret = rdr_nl_talk(s, &req->h, reply, REPLY_MAX);
	close(s);
	if (ret == 0 && (h->nlmsg_type != NFT_MSG(msg) || h->nlmsg_len < NLMSG_LENGTH(sizeof(struct nfgenmsg))))
		ret = -EPROTO;
	if (ret != 0) {
		free(reply);
		return ret == -EOPNOTSUPP || ret == -EPROTONOSUPPORT ? -ENOENT : ret;
	}
	len = (int)(h->nlmsg_len - NLMSG_LENGTH(sizeof(struct nfgenmsg)));
	for (rta = (const struct rtattr *)((const char *)NLMSG_DATA(h) + NLMSG_ALIGN(sizeof(struct nfgenmsg)));
	     RTA_OK(rta, len); rta = RTA_NEXT(rta, len)) {
		unsigned short t = (unsigned short)(rta->rta_type & NLA_TYPE_MASK);

		if (msg == NFT_MSG_NEWTABLE) {
			if (t == NFTA_TABLE_FLAGS)
				out->flags = attr_u32(rta);
			else if (t == NFTA_TABLE_USE)
				out->use = attr_u32(rta);
			else if (t == NFTA_TABLE_USERDATA)
				udata_comment(rta, out);
		} else {
			if (t == NFTA_CHAIN_FLAGS)
				out->flags = attr_u32(rta);
			else if (t == NFTA_CHAIN_USE)
				out->use = attr_u32(rta);
			else if (t == NFTA_CHAIN_POLICY)
				out->policy = attr_u32(rta);
			else if (t == NFTA_CHAIN_HOOK)
				out->hook = 1;
			else if (t == NFTA_CHAIN_USERDATA)
				udata_comment(rta, out);
		}
	}
	free(reply);
	return 0;
}

int rdr_nft_table(int family, const char *table, struct rdr_nft_obj *out)
{
	struct rdr_nlreq req;
	int ret;

	obj_clear(out);
	ret = obj_request(&req, NFT_MSG_GETTABLE, 0, family, NFTA_TABLE_NAME, table, 0, NULL);
	return ret < 0 ? ret : obj_get(&req, NFT_MSG_NEWTABLE, out);
}

struct rule_seen {
	const char *table, *chain;
};

/* 1 at a rule of the table and chain asked for (a kernel that does not filter the dump by them
 * sends others too). */
static int on_rule(void *arg, const struct nlmsghdr *h)
{
	const struct rule_seen *want = arg;
	const struct rtattr *rta;
	int len, table = 0, chain = 0;

	if (h->nlmsg_type != NFT_MSG(NFT_MSG_NEWRULE) || h->nlmsg_len < NLMSG_LENGTH(sizeof(struct nfgenmsg)))
		return 0;
	len = (int)(h->nlmsg_len - NLMSG_LENGTH(sizeof(struct nfgenmsg)));
	for (rta = (const struct rtattr *)((const char *)NLMSG_DATA(h) + NLMSG_ALIGN(sizeof(struct nfgenmsg)));
	     RTA_OK(rta, len); rta = RTA_NEXT(rta, len)) {
		unsigned short t = (unsigned short)(rta->rta_type & NLA_TYPE_MASK);
		const char *want_name = t == NFTA_RULE_TABLE ? want->table : t == NFTA_RULE_CHAIN ? want->chain : NULL;
		size_t wl;

		if (!want_name)
			continue;
		wl = strlen(want_name);
		if (RTA_PAYLOAD(rta) >= wl + 1 && memcmp(RTA_DATA(rta), want_name, wl + 1) == 0)
			*(t == NFTA_RULE_TABLE ? &table : &chain) = 1;
	}
	return table && chain;
}

int rdr_nft_chain(int family, const char *table, const char *chain, struct rdr_nft_obj *out)
{
	struct rule_seen want = {table, chain};
	struct rdr_nlreq req;
	char *buf;
	int s, ret;

	obj_clear(out);
	ret = obj_request(&req, NFT_MSG_GETCHAIN, 0, family, NFTA_CHAIN_TABLE, table, NFTA_CHAIN_NAME, chain);
	if (ret == 0)
		ret = obj_get(&req, NFT_MSG_NEWCHAIN, out);
	if (ret != 0)
		return ret;
	/* Its rules: a dump of the chain's (NFTA_CHAIN_USE counts the jumps to it, not its rules),
	 * stopped at the first. */
	ret = obj_request(&req, NFT_MSG_GETRULE, 0, family, NFTA_RULE_TABLE, table, NFTA_RULE_CHAIN, chain);
	if (ret != 0)
		return ret;
	buf = malloc(2 * (size_t)REPLY_MAX);
	if (!buf)
		return -ENOMEM;
	s = rdr_nl_socket(NETLINK_NETFILTER);
	if (s < 0) {
		free(buf);
		return s;
	}
	ret = rdr_nl_dump_whole(s, &req.h, buf, REPLY_MAX, on_rule, NULL, &want);
	close(s);
	free(buf);
	if (ret < 0)
		return ret;
	out->rules = ret > 0;
	return 0;
}
