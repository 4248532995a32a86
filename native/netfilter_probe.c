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
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/netfilter/nf_tables.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netlink.h>
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
	ret = rdr_nl_dump(s, &req.h, buf[0], sizeof(buf[0]), on_table, NULL);
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
