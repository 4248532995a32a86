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

#include "redirect_native.h"

/* 1 if nf_tables has a table here, 0 if none (or no nf_tables in this kernel), -errno. */
static int nft_tables(void)
{
	struct {
		struct nlmsghdr nh;
		struct nfgenmsg g;
	} req;
	struct sockaddr_nl sa = {.nl_family = AF_NETLINK};
	char buf[8192];
	int s, ret = -EIO;

	s = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_NETFILTER);
	if (s < 0)
		return errno == EPROTONOSUPPORT || errno == EAFNOSUPPORT ? 0 : -errno;
	memset(&req, 0, sizeof(req));
	req.nh.nlmsg_len = sizeof(req);
	req.nh.nlmsg_type = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE;
	req.nh.nlmsg_flags = NLM_F_REQUEST | NLM_F_DUMP;
	req.nh.nlmsg_seq = 1;
	req.g.nfgen_family = AF_UNSPEC;
	req.g.version = NFNETLINK_V0;
	if (sendto(s, &req, sizeof(req), 0, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		ret = -errno;
		goto out;
	}
	for (int rounds = 0; rounds < 64; rounds++) {
		ssize_t n = recv(s, buf, sizeof(buf), 0);

		if (n < 0) {
			ret = -errno;
			goto out;
		}
		for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, n); h = NLMSG_NEXT(h, n)) {
			if (h->nlmsg_type == NLMSG_DONE) {
				ret = 0;
				goto out;
			}
			if (h->nlmsg_type == NLMSG_ERROR) {
				int err = ((struct nlmsgerr *)NLMSG_DATA(h))->error;

				/* No nf_tables subsystem: no tables. */
				ret = err == -EOPNOTSUPP || err == -ENOENT || err == -EPROTONOSUPPORT ? 0 : err ? err : -EIO;
				goto out;
			}
			if (h->nlmsg_type == ((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE)) {
				ret = 1;
				goto out;
			}
		}
	}
out:
	close(s);
	return ret;
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
