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

/* --- bpf(2) --------------------------------------------------------------- */
#include <linux/bpf.h>
#include <string.h>
#include <sys/syscall.h>

#ifndef __NR_pidfd_getfd
#define __NR_pidfd_getfd 438
#endif

static int sys_bpf(int cmd, union bpf_attr *attr)
{
	long ret = syscall(__NR_bpf, cmd, attr, sizeof(*attr));

	return ret < 0 ? -errno : (int)ret;
}

int rdr_bpf_obj_pin(int fd, const char *path)
{
	union bpf_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.pathname = (uint64_t)(uintptr_t)path;
	attr.bpf_fd = (uint32_t)fd;
	return sys_bpf(BPF_OBJ_PIN, &attr);
}

int rdr_bpf_obj_get(const char *path)
{
	union bpf_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.pathname = (uint64_t)(uintptr_t)path;
	return sys_bpf(BPF_OBJ_GET, &attr);
}

int rdr_bpf_link_create(int prog_fd, int target_fd, uint32_t attach_type, uint32_t flags)
{
	union bpf_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.link_create.prog_fd = (uint32_t)prog_fd;
	attr.link_create.target_fd = (uint32_t)target_fd;
	attr.link_create.attach_type = attach_type;
	attr.link_create.flags = flags;
	return sys_bpf(BPF_LINK_CREATE, &attr);
}

int rdr_bpf_link_detach(int link_fd)
{
	union bpf_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.link_detach.link_fd = (uint32_t)link_fd;
	return sys_bpf(BPF_LINK_DETACH, &attr);
}

static int map_elem(int cmd, int map_fd, const void *key, void *value, uint64_t flags)
{
	union bpf_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.map_fd = (uint32_t)map_fd;
	attr.key = (uint64_t)(uintptr_t)key;
	attr.value = (uint64_t)(uintptr_t)value; /* next_key shares this slot */
	attr.flags = flags;
	return sys_bpf(cmd, &attr);
}

int rdr_bpf_map_update(int map_fd, const void *key, const void *value, uint64_t flags)
{
	return map_elem(BPF_MAP_UPDATE_ELEM, map_fd, key, (void *)value, flags);
}

int rdr_bpf_map_lookup(int map_fd, const void *key, void *value)
{
	return map_elem(BPF_MAP_LOOKUP_ELEM, map_fd, key, value, 0);
}

int rdr_bpf_map_delete(int map_fd, const void *key)
{
	return map_elem(BPF_MAP_DELETE_ELEM, map_fd, key, NULL, 0);
}

int rdr_bpf_map_next_key(int map_fd, const void *key, void *next_key)
{
	return map_elem(BPF_MAP_GET_NEXT_KEY, map_fd, key, next_key, 0);
}

static int obj_info(int fd, void *info, uint32_t len)
{
	union bpf_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.info.bpf_fd = (uint32_t)fd;
	attr.info.info_len = len;
	attr.info.info = (uint64_t)(uintptr_t)info;
	return sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &attr);
}

int rdr_bpf_prog_id(int prog_fd, uint32_t *id)
{
	struct bpf_prog_info info;
	int ret;

	memset(&info, 0, sizeof(info));
	ret = obj_info(prog_fd, &info, sizeof(info));
	if (ret < 0)
		return ret;
	*id = info.id;
	return 0;
}

int rdr_bpf_link_info(int link_fd, uint32_t *id, uint32_t *type, uint32_t *prog_id,
		      uint32_t *attach_type, uint64_t *target)
{
	struct bpf_link_info info;
	int ret;

	memset(&info, 0, sizeof(info));
	ret = obj_info(link_fd, &info, sizeof(info));
	if (ret < 0)
		return ret;
	*id = info.id;
	*type = info.type;
	*prog_id = info.prog_id;
	*attach_type = 0;
	*target = 0;
	if (info.type == BPF_LINK_TYPE_NETNS) {
		*attach_type = info.netns.attach_type;
		*target = info.netns.netns_ino;
	} else if (info.type == BPF_LINK_TYPE_CGROUP) {
		*attach_type = info.cgroup.attach_type;
		*target = info.cgroup.cgroup_id;
	}
	return 0;
}

int rdr_pidfd_getfd(int pidfd, int fd)
{
	long ret = syscall(__NR_pidfd_getfd, pidfd, fd, 0);

	return ret < 0 ? -errno : (int)ret;
}
