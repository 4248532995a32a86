#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <linux/magic.h>
#include <linux/mount.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
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

/* --- the calling thread's own netns ---------------------------------------- */
#ifndef __NR_pidfd_open
#define __NR_pidfd_open 434
#endif
#ifndef PIDFD_THREAD
#define PIDFD_THREAD O_EXCL /* 6.9 */
#endif
#ifndef PIDFD_GET_NET_NAMESPACE
#define PIDFD_GET_NET_NAMESPACE _IO(0xFF, 4) /* 6.11 */
#endif

/* What a thread keeps open for its later calls: a pidfd of itself, and a procfs instance of its
 * own (rdr_sysctl_open) with the look-ups made through it. Closed when the thread exits (a pthread
 * key's destructor), and in a forked child (pthread_atfork: its copies are its parent thread's,
 * which it does not use). */
struct thread_fds {
	int pidfd;
	int procfs; /* -1: none yet; -2: none to be had, /proc/sys instead */
	int procfs_uses;
};
static __thread struct thread_fds tfd = {-1, -1, 0};
static pthread_key_t tfd_key;
static pthread_once_t tfd_once = PTHREAD_ONCE_INIT;
static int tfd_key_ok;

static void tfd_close(void *v)
{
	struct thread_fds *t = v;

	if (t->pidfd >= 0)
		close(t->pidfd);
	if (t->procfs >= 0)
		close(t->procfs);
	t->pidfd = t->procfs = -1;
}

static void tfd_forked(void)
{
	tfd_close(&tfd);
	tfd.procfs_uses = 0;
}

static void tfd_key_init(void)
{
	tfd_key_ok = pthread_key_create(&tfd_key, tfd_close) == 0 && pthread_atfork(NULL, NULL, tfd_forked) == 0;
}

/* The calling thread's fds, with their destructor registered: NULL if that can't be (then none is
 * kept). */
static struct thread_fds *thread_fds(void)
{
	pthread_once(&tfd_once, tfd_key_init);
	if (!tfd_key_ok)
		return NULL;
	if (tfd.pidfd == -1 && tfd.procfs == -1 && pthread_getspecific(tfd_key) == NULL &&
	    pthread_setspecific(tfd_key, &tfd) != 0)
		return NULL;
	return &tfd;
}

int rdr_thread_netns(void)
{
	struct thread_fds *t = thread_fds();
	int fd;

	if (t != NULL && t->pidfd < 0)
		t->pidfd = (int)syscall(__NR_pidfd_open, gettid(), PIDFD_THREAD);
	/* An ioctl on the pidfd skips the procfs path walk of the open below (a look-up per path
	 * component, each a cache miss when cold: docs/kernel-facts.md); kernels before 6.11 (no
	 * such ioctl) or 6.9 (no thread pidfds) open. */
	if (t != NULL && t->pidfd >= 0) {
		fd = ioctl(t->pidfd, PIDFD_GET_NET_NAMESPACE, 0);
		if (fd >= 0)
			return fd;
	}
	fd = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
	return fd < 0 ? -errno : fd;
}

/* --- sysctls of the calling thread's netns ------------------------------------- */

/* A procfs instance for rdr_sysctl_open (a detached mount: fsopen and fsmount, CAP_SYS_ADMIN),
 * only where /proc/sys/net is procfs and writable, so that it opens nothing /proc/sys does not
 * (a runtime mounts /proc/sys read-only in a container, and masks paths with other mounts); -2
 * where there is none to be had (no such capability or system calls, a read-only or masked
 * /proc/sys/net). Only /proc/sys/net is looked at: a mount on a file or directory below it would
 * not be seen (runtimes mask none there). */
static int procfs_new(void)
{
	struct statfs sf;
	int fs, m = -1;

	if (statfs("/proc/sys/net", &sf) < 0 || sf.f_type != PROC_SUPER_MAGIC || (sf.f_flags & ST_RDONLY))
		return -2;
	fs = (int)syscall(__NR_fsopen, "proc", FSOPEN_CLOEXEC);
	if (fs < 0)
		return -2;
	if (syscall(__NR_fsconfig, fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) == 0)
		m = (int)syscall(__NR_fsmount, fs, FSMOUNT_CLOEXEC, 0);
	close(fs);
	return m >= 0 ? m : -2;
}

int rdr_sysctl_open(const char *name, int flags)
{
	struct thread_fds *t = thread_fds();
	char path[128];
	int fd;

	if (strlen(name) + sizeof("/proc/sys/") > sizeof(path))
		return -ENAMETOOLONG;
	if (t != NULL && (t->procfs == -1 || (t->procfs >= 0 && t->procfs_uses >= RDR_SYSCTL_LOOKUPS))) {
		int m = procfs_new();

		if (t->procfs >= 0)
			close(t->procfs); /* (its entries go with it) */
		t->procfs = m;
		t->procfs_uses = 0;
	}
	if (t != NULL && t->procfs >= 0) {
		t->procfs_uses++;
		snprintf(path, sizeof(path), "sys/%s", name);
		fd = openat(t->procfs, path, flags | O_CLOEXEC);
	} else {
		snprintf(path, sizeof(path), "/proc/sys/%s", name);
		fd = open(path, flags | O_CLOEXEC);
	}
	return fd < 0 ? -errno : fd;
}

/* --- pin directory watches --------------------------------------------------- */

int rdr_watch_new(void)
{
	int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);

	return fd < 0 ? -errno : fd;
}

int rdr_watch_add(int fd, const char *const *dirs, int n)
{
	int ret = 0;

	for (int i = 0; i < n; i++)
		if (inotify_add_watch(fd, dirs[i], IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO |
						   IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR) < 0 && ret == 0)
			ret = -errno;
	return ret;
}

int rdr_watch_changed(int fd)
{
	char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
	ssize_t got;
	int changed = 0;

	for (int i = 0; i < 64; i++) { /* drain; bounded (each read takes up to 4 KiB of events) */
		got = read(fd, buf, sizeof(buf));
		if (got > 0) {
			changed = 1;
			continue;
		}
		if (got < 0 && errno == EAGAIN)
			return changed;
		return got < 0 ? -errno : 1; /* 0: can't happen on inotify; say "changed" */
	}
	return 1;
}

int rdr_watch_pending(int fd)
{
	int n = 0;

	return ioctl(fd, FIONREAD, &n) < 0 ? -errno : n > 0;
}

int rdr_netns_cookie(int netns_fd, uint64_t *cookie)
{
	int self, sock, ret;

	self = rdr_thread_netns();
	if (self < 0)
		return self;
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

static int read_all(const char *path, char *buf, int len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC), n = 0, r, ret = 0;

	if (fd < 0)
		return -errno;
	while ((r = read(fd, buf + n, len - 1 - n)) > 0)
		n += r;
	if (r < 0)
		ret = -errno;
	else if (n == len - 1)
		ret = -E2BIG;
	buf[n] = 0;
	close(fd);
	return ret;
}

int rdr_netns_userns(int netns_fd, int *us)
{
	struct stat st;
	int fd = ioctl(netns_fd, NS_GET_USERNS), ret;

	if (fd < 0)
		return -errno;
	if (fstat(fd, &st) < 0) {
		ret = -errno;
		close(fd);
		return ret;
	}
	if (st.st_ino == RDR_USER_INIT_INO) {
		close(fd);
		return 0;
	}
	*us = fd;
	return 1;
}

int rdr_netns_id_maps(int netns_fd, char *uid_map, int uid_len, char *gid_map, int gid_len)
{
	int us = -1, ret, err = 0, ready[2], hold[2], status;
	char path[64];
	pid_t pid;

	ret = rdr_netns_userns(netns_fd, &us);
	if (ret <= 0)
		return ret;
	if (pipe2(ready, O_CLOEXEC) < 0) {
		ret = -errno;
		close(us);
		return ret;
	}
	if (pipe2(hold, O_CLOEXEC) < 0) {
		ret = -errno;
		close(ready[0]);
		close(ready[1]);
		close(us);
		return ret;
	}
	pid = fork();
	if (pid == 0) {
		/* The child of a process that may have many threads: syscalls only. It enters the
		 * user namespace, says so (0, or its errno), and waits until the parent has read its
		 * maps (the parent's end closed, whether the parent finished or died). */
		char c;

		close(ready[0]);
		close(hold[1]);
		if (setns(us, CLONE_NEWUSER) < 0)
			err = errno;
		if (write(ready[1], &err, sizeof(err)) < 0)
			_exit(1);
		while (read(hold[0], &c, 1) < 0 && errno == EINTR)
			;
		_exit(0);
	}
	ret = pid < 0 ? -errno : 0;
	close(ready[1]);
	close(hold[0]);
	close(us);
	if (pid > 0) {
		ssize_t r;

		while ((r = read(ready[0], &err, sizeof(err))) < 0 && errno == EINTR)
			;
		if (r != (ssize_t)sizeof(err))
			ret = -ECHILD;
		else if (err != 0)
			ret = -err;
		if (ret == 0) {
			snprintf(path, sizeof(path), "/proc/%d/uid_map", (int)pid);
			ret = read_all(path, uid_map, uid_len);
		}
		if (ret == 0) {
			snprintf(path, sizeof(path), "/proc/%d/gid_map", (int)pid);
			ret = read_all(path, gid_map, gid_len);
		}
	}
	close(ready[0]);
	close(hold[1]); /* the child exits */
	if (pid > 0)
		while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
			;
	return ret < 0 ? ret : 1;
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

#ifndef BPF_F_PATH_FD
#define BPF_F_PATH_FD (1U << 14) /* 6.5: pathname is relative to path_fd */
#endif

int rdr_bpf_obj_pin_at(int fd, int dir_fd, const char *name)
{
	/* union bpf_attr's obj fields with path_fd, which headers before 6.5 lack. */
	struct {
		uint64_t pathname;
		uint32_t bpf_fd;
		uint32_t file_flags;
		int32_t path_fd;
		uint32_t pad;
	} attr;

	memset(&attr, 0, sizeof(attr));
	attr.pathname = (uint64_t)(uintptr_t)name;
	attr.bpf_fd = (uint32_t)fd;
	attr.file_flags = BPF_F_PATH_FD;
	attr.path_fd = dir_fd;
	return syscall(__NR_bpf, BPF_OBJ_PIN, &attr, sizeof(attr)) < 0 ? -errno : 0;
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

int rdr_bpf_map_pop(int map_fd, void *value)
{
	return map_elem(BPF_MAP_LOOKUP_AND_DELETE_ELEM, map_fd, NULL, value, 0);
}

int rdr_bpf_map_push(int map_fd, const void *value)
{
	return map_elem(BPF_MAP_UPDATE_ELEM, map_fd, NULL, (void *)value, 0);
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

int rdr_bpf_prog_query(int target_fd, uint32_t attach_type, uint32_t *ids, uint32_t *n)
{
	union bpf_attr attr;
	int ret;

	memset(&attr, 0, sizeof(attr));
	attr.query.target_fd = (uint32_t)target_fd;
	attr.query.attach_type = attach_type;
	attr.query.prog_ids = (uint64_t)(uintptr_t)ids;
	attr.query.prog_cnt = *n;
	ret = sys_bpf(BPF_PROG_QUERY, &attr);
	if (ret < 0 && ret != -ENOSPC)
		return ret;
	*n = attr.query.prog_cnt;
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
	} else if (info.type == 11) {
		/* BPF_LINK_TYPE_TCX (6.6+, newer than the headers this may be built with): its info is
		 * {__u32 ifindex; __u32 attach_type;}, laid out as the netns one; ifindex 0: detached. */
		*attach_type = info.netns.attach_type;
		*target = info.netns.netns_ino;
	}
	return 0;
}

int rdr_pidfd_getfd(int pidfd, int fd)
{
	long ret = syscall(__NR_pidfd_getfd, pidfd, fd, 0);

	return ret < 0 ? -errno : (int)ret;
}

/* --- the pods' sk_lookup stubs ---------------------------------------------------------------- */

/* BPF_PROG_LOAD of n instructions (GPL), named name (at most 15 characters): its fd, or -errno. */
static int prog_load(uint32_t type, uint32_t attach_type, const struct bpf_insn *insns, uint32_t n, const char *name)
{
	union bpf_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.prog_type = type;
	attr.expected_attach_type = attach_type;
	attr.insns = (uint64_t)(uintptr_t)insns;
	attr.insn_cnt = n;
	attr.license = (uint64_t)(uintptr_t)"GPL";
	strncpy(attr.prog_name, name, sizeof(attr.prog_name) - 1);
	return sys_bpf(BPF_PROG_LOAD, &attr);
}

int rdr_reuseport_migrate_prog(void)
{
	static const struct bpf_insn insns[] = {
		{.code = BPF_ALU64 | BPF_MOV | BPF_K, .dst_reg = 0, .imm = 1 /* SK_PASS */},
		{.code = BPF_JMP | BPF_EXIT},
	};

	return prog_load(BPF_PROG_TYPE_SK_REUSEPORT, BPF_SK_REUSEPORT_SELECT_OR_MIGRATE, insns,
			 sizeof(insns) / sizeof(insns[0]), "rdr_migrate");
}

#define STUB_NAME "rdr_pod_lookup"
#define STUB_SLOT_OFF (-4) /* the stack slot the slot number is stored to, as lookup_slots' key */

int rdr_ebpf_pool_prog(int slots_map_fd, int netns_map_fd, int prog_map_fd, uint32_t slot)
{
	/* r6 = ctx; key = slot; r7 = lookup_slots[key].netns (none: SK_PASS); lookup_netns[0] = r7;
	 * tail_call(ctx, lookup_prog, 0); return SK_PASS */
	struct bpf_insn insns[] = {
		{.code = BPF_ALU64 | BPF_MOV | BPF_X, .dst_reg = 6, .src_reg = 1},
		{.code = BPF_ST | BPF_MEM | BPF_W, .dst_reg = 10, .off = STUB_SLOT_OFF, .imm = (int32_t)slot},
		{.code = BPF_LD | BPF_DW | BPF_IMM, .dst_reg = 1, .src_reg = BPF_PSEUDO_MAP_FD, .imm = slots_map_fd},
		{.imm = 0},
		{.code = BPF_ALU64 | BPF_MOV | BPF_X, .dst_reg = 2, .src_reg = 10},
		{.code = BPF_ALU64 | BPF_ADD | BPF_K, .dst_reg = 2, .imm = STUB_SLOT_OFF},
		{.code = BPF_JMP | BPF_CALL, .imm = BPF_FUNC_map_lookup_elem},
		{.code = BPF_JMP | BPF_JEQ | BPF_K, .dst_reg = 0, .off = 15, .imm = 0},
		{.code = BPF_LDX | BPF_MEM | BPF_DW, .dst_reg = 7, .src_reg = 0, .off = 0}, /* pool_slot.netns */
		{.code = BPF_ST | BPF_MEM | BPF_W, .dst_reg = 10, .off = -8, .imm = 0},
		{.code = BPF_LD | BPF_DW | BPF_IMM, .dst_reg = 1, .src_reg = BPF_PSEUDO_MAP_FD, .imm = netns_map_fd},
		{.imm = 0},
		{.code = BPF_ALU64 | BPF_MOV | BPF_X, .dst_reg = 2, .src_reg = 10},
		{.code = BPF_ALU64 | BPF_ADD | BPF_K, .dst_reg = 2, .imm = -8},
		{.code = BPF_JMP | BPF_CALL, .imm = BPF_FUNC_map_lookup_elem},
		{.code = BPF_JMP | BPF_JEQ | BPF_K, .dst_reg = 0, .off = 7, .imm = 0},
		{.code = BPF_STX | BPF_MEM | BPF_DW, .dst_reg = 0, .src_reg = 7},
		{.code = BPF_ALU64 | BPF_MOV | BPF_X, .dst_reg = 1, .src_reg = 6},
		{.code = BPF_LD | BPF_DW | BPF_IMM, .dst_reg = 2, .src_reg = BPF_PSEUDO_MAP_FD, .imm = prog_map_fd},
		{.imm = 0},
		/* The index: ctx->family >> 16, 0 at run time. A constant the verifier can see would make
		 * this a direct tail call, whose jump the kernel patches into the program's text at load
		 * (text_poke, a cross-CPU synchronisation): several times the cost of the whole load. */
		{.code = BPF_LDX | BPF_MEM | BPF_W, .dst_reg = 3, .src_reg = 6,
		 .off = offsetof(struct bpf_sk_lookup, family)},
		{.code = BPF_ALU64 | BPF_RSH | BPF_K, .dst_reg = 3, .imm = 16},
		{.code = BPF_JMP | BPF_CALL, .imm = BPF_FUNC_tail_call},
		{.code = BPF_ALU64 | BPF_MOV | BPF_K, .dst_reg = 0, .imm = 1 /* SK_PASS */},
		{.code = BPF_JMP | BPF_EXIT},
	};

	return prog_load(BPF_PROG_TYPE_SK_LOOKUP, BPF_SK_LOOKUP, insns, sizeof(insns) / sizeof(insns[0]), STUB_NAME);
}

int rdr_ebpf_pool_prog_slot(uint32_t prog_id, uint32_t *slot)
{
	struct bpf_insn insns[128];
	struct bpf_prog_info info;
	union bpf_attr attr;
	int fd, ret;
	uint32_t n;

	memset(&attr, 0, sizeof(attr));
	attr.prog_id = prog_id;
	fd = sys_bpf(BPF_PROG_GET_FD_BY_ID, &attr);
	if (fd < 0)
		return fd;
	memset(&info, 0, sizeof(info));
	info.xlated_prog_len = sizeof(insns);
	info.xlated_prog_insns = (uint64_t)(uintptr_t)insns;
	ret = obj_info(fd, &info, sizeof(info));
	close(fd);
	if (ret < 0)
		return ret;
	if (info.type != BPF_PROG_TYPE_SK_LOOKUP || strcmp(info.name, STUB_NAME) != 0 ||
	    info.xlated_prog_len > sizeof(insns))
		return -ENOENT;
	n = info.xlated_prog_len / sizeof(insns[0]);
	for (uint32_t i = 0; i < n; i++) {
		if (insns[i].code == (BPF_ST | BPF_MEM | BPF_W) && insns[i].dst_reg == 10 &&
		    insns[i].off == STUB_SLOT_OFF) {
			*slot = (uint32_t)insns[i].imm;
			return 0;
		}
	}
	return -ENOENT;
}

/* --- finding objects whose pins are gone -------------------------------------------------------- */

int rdr_bpf_prog_get_fd_by_id(uint32_t id)
{
	union bpf_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.prog_id = id;
	return sys_bpf(BPF_PROG_GET_FD_BY_ID, &attr);
}

int rdr_bpf_map_get_fd_by_id(uint32_t id)
{
	union bpf_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.map_id = id;
	return sys_bpf(BPF_MAP_GET_FD_BY_ID, &attr);
}

int rdr_bpf_prog_map_ids(int prog_fd, uint32_t *ids, uint32_t max)
{
	struct bpf_prog_info info;
	int ret;

	memset(&info, 0, sizeof(info));
	info.nr_map_ids = max;
	info.map_ids = (uint64_t)(uintptr_t)ids;
	ret = obj_info(prog_fd, &info, sizeof(info));
	if (ret < 0)
		return ret;
	return (int)(info.nr_map_ids < max ? info.nr_map_ids : max);
}

int rdr_bpf_map_name(int map_fd, char *name)
{
	struct bpf_map_info info;
	int ret;

	memset(&info, 0, sizeof(info));
	ret = obj_info(map_fd, &info, sizeof(info));
	if (ret < 0)
		return ret;
	memcpy(name, info.name, sizeof(info.name));
	name[sizeof(info.name) - 1] = 0;
	return 0;
}
