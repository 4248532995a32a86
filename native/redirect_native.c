#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include "redirect_native.h"

#ifndef SO_NETNS_COOKIE
#define SO_NETNS_COOKIE 71
#endif

int rdr_setns(int fd, int nstype)
{
	return setns(fd, nstype) == 0 ? 0 : -errno;
}

int rdr_sock_netns_cookie(int sockfd, uint64_t *cookie)
{
	socklen_t len = sizeof(*cookie);

	if (getsockopt(sockfd, SOL_SOCKET, SO_NETNS_COOKIE, cookie, &len) < 0)
		return -errno;
	return 0;
}

int rdr_netns_cookie(int netns_fd, uint64_t *cookie)
{
	int self, sock, ret;

	self = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
	if (self < 0)
		return -errno;
	if (setns(netns_fd, CLONE_NEWNET) < 0) {
		ret = -errno;
		close(self);
		return ret;
	}
	sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	ret = sock < 0 ? -errno : rdr_sock_netns_cookie(sock, cookie);
	if (sock >= 0)
		close(sock);
	/* Coming back can only fail if the kernel is out of memory; there is no
	 * sane way on from there for this thread, so report it loudly. */
	if (setns(self, CLONE_NEWNET) < 0)
		ret = -errno;
	close(self);
	return ret;
}
