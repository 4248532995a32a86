/* redirect native helpers: the few syscalls Python 3.11 and bcc do not expose.
 * Every function returns >= 0 on success and -errno on failure, so the Python
 * side can raise OSError with the right code without reading errno itself. */
#include <stdint.h>

#include "abi.h" /* redirect/bpf/abi.h: the eBPF maps' keys and values */

/* setns(2) on the calling thread. nstype 0 or CLONE_NEWNET. */
int rdr_setns(int fd, int nstype);

/* The network namespace cookie (SO_NETNS_COOKIE) of the netns a socket lives in.
 * Written to *cookie. */
int rdr_sock_netns_cookie(int sockfd, uint64_t *cookie);

/* A new fd of the calling thread's current netns (what /proc/thread-self/ns/net opens, by
 * an ioctl on a pidfd of the thread where the kernel has it). */
int rdr_thread_netns(void);

/* A new inotify fd (non-blocking, close-on-exec). */
int rdr_watch_new(void);

/* Watch n directories on it for entries created, deleted or moved, and for the directories
 * themselves going (adding one already watched is harmless). 0, or the first -errno. */
int rdr_watch_add(int fd, const char *const *dirs, int n);

/* 1 if anything happened since the last call (the events are read and dropped), 0 if not. */
int rdr_watch_changed(int fd);

/* 1 if events are waiting (left there for rdr_watch_changed), 0 if not. */
int rdr_watch_pending(int fd);

/* A file of the calling thread's netns's sysctls, name relative to /proc/sys ("net/ipv4/..."), opened
 * with flags (close-on-exec added): the fd, or -errno. A /proc/sys/net look-up of a netns walks one
 * dcache hash chain that holds that directory's entry of each netns looked up through the same
 * procfs instance (docs/kernel-facts.md), so its cost grows with the number of pods: each thread
 * looks up through a procfs instance of its own, replaced after RDR_SYSCTL_LOOKUPS look-ups (the
 * entries of the old one go with it); through /proc/sys where it can't have one (no CAP_SYS_ADMIN,
 * a read-only or masked /proc/sys: it opens nothing /proc/sys would not). */
#define RDR_SYSCTL_LOOKUPS 16
int rdr_sysctl_open(const char *name, int flags);

/* The cookie of the netns behind an open netns fd: enters it on this thread,
 * opens a socket, reads the cookie, returns. Leaves the thread where it was. */
int rdr_netns_cookie(int netns_fd, uint64_t *cookie);

/* The user namespace that owns the netns behind netns_fd (ioctl NS_GET_USERNS): 0 when it is the
 * initial one (the ids a task has there are the ids the eBPF programs read), 1 when it is another,
 * whose uid_map and gid_map, as the initial user namespace numbers them (the third field of each
 * line), are then written to uid_map and gid_map (NUL-terminated, at most len - 1 bytes each); or
 * -errno (-E2BIG: a map longer than its buffer). A map is read from /proc/<pid>/ of a short-lived
 * child process (fork) that entered that user namespace and waits there: only a process with one
 * thread may setns() into a user namespace, and a namespace file tells nothing of its maps. */
#define RDR_USER_INIT_INO 0xEFFFFFFD /* the initial user namespace's inode (PROC_USER_INIT_INO: fixed) */
#ifndef NS_GET_USERNS
#define NS_GET_USERNS 0xb701 /* _IO(0xb7, 0x1), linux/nsfs.h */
#endif
/* Which user namespace owns the netns behind netns_fd: 0 the initial one, 1 another (its fd in *us,
 * the caller closes it), or -errno. The one statement of that question (rdr_netns_id_maps, and the
 * fresh-pod call's back-off). */
int rdr_netns_userns(int netns_fd, int *us);
#define RDR_USERNS_MAP_MAX 16384 /* a map has at most 340 lines of three 10-digit numbers */
int rdr_netns_id_maps(int netns_fd, char *uid_map, int uid_len, char *gid_map, int gid_len);

/* --- bpf(2) and pidfd: what bcc's Python does not offer ------------------- */

/* BPF_OBJ_PIN: pin the map/prog/link behind fd at path (on a bpffs). */
int rdr_bpf_obj_pin(int fd, const char *path);

/* BPF_OBJ_PIN at name in the directory dir_fd (BPF_F_PATH_FD, 6.5; -EINVAL before). */
int rdr_bpf_obj_pin_at(int fd, int dir_fd, const char *name);

/* BPF_OBJ_GET: open a pinned object; returns a new fd. */
int rdr_bpf_obj_get(const char *path);

/* BPF_LINK_CREATE: attach prog_fd to target_fd (a cgroup dir fd, or a netns fd
 * for sk_lookup) with attach_type; returns the link fd. */
int rdr_bpf_link_create(int prog_fd, int target_fd, uint32_t attach_type, uint32_t flags);

/* BPF_LINK_DETACH: detach a link now, even while pins or fds still hold it. */
int rdr_bpf_link_detach(int link_fd);

/* Map element operations (BPF_MAP_UPDATE_ELEM, LOOKUP, DELETE, GET_NEXT_KEY).
 * key == NULL in next_key asks for the first key. */
int rdr_bpf_map_update(int map_fd, const void *key, const void *value, uint64_t flags);
int rdr_bpf_map_lookup(int map_fd, const void *key, void *value);
int rdr_bpf_map_delete(int map_fd, const void *key);
int rdr_bpf_map_next_key(int map_fd, const void *key, void *next_key);
/* A queue map's (no key): take its oldest value, or add one at its end; -ENOENT empty, -E2BIG full. */
int rdr_bpf_map_pop(int map_fd, void *value);
int rdr_bpf_map_push(int map_fd, const void *value);

/* BPF_OBJ_GET_INFO_BY_FD for a program: its id. */
int rdr_bpf_prog_id(int prog_fd, uint32_t *id);

/* BPF_PROG_QUERY of target_fd (a map: sockmap and sockhash answer since 5.19) for attach_type: the
 * ids of the programs attached there (at most *n; *n set to how many there are). */
int rdr_bpf_prog_query(int target_fd, uint32_t attach_type, uint32_t *ids, uint32_t *n);

/* BPF_OBJ_GET_INFO_BY_FD for a link: its id, type, program id, attach type, and
 * its target (netns inode for netns links, cgroup id for cgroup links). */
int rdr_bpf_link_info(int link_fd, uint32_t *id, uint32_t *type, uint32_t *prog_id,
		      uint32_t *attach_type, uint64_t *target);

/* A BPF_PROG_TYPE_SK_REUSEPORT program of attach type BPF_SK_REUSEPORT_SELECT_OR_MIGRATE (5.14)
 * that selects nothing (SK_PASS): attached to a reuseport group (SO_ATTACH_REUSEPORT_EBPF), the
 * kernel picks a listener by hash as without it, and, when a listener of the group closes, moves
 * the connections queued on it to another one of the group instead of resetting them, whatever
 * net.ipv4.tcp_migrate_req says. Its fd, or -errno. */
int rdr_reuseport_migrate_prog(void);

/* A pods' sk_lookup program for pool slot `slot` (BPF_PROG_LOAD, a new fd): reads its pod's netns
 * cookie from lookup_slots[slot] (slots_map_fd), stores it in lookup_netns (netns_map_fd) and
 * tail-calls rdr_sk_lookup from lookup_prog (prog_map_fd) (redirect/bpf/redirect.h: sk_lookup can't ask for
 * the netns cookie itself). */
int rdr_ebpf_pool_prog(int slots_map_fd, int netns_map_fd, int prog_map_fd, uint32_t slot);

/* The slot such a program holds, from its id: 0, or -ENOENT if the program is not one. */
int rdr_ebpf_pool_prog_slot(uint32_t prog_id, uint32_t *slot);

/* --- the tc filters of a pod that forwards (tc_filter.c, redirect/bpf/tc_forward.c) ---------------- */

#define RDR_TC_PRIO 0xC0DE /* the priority of our filters in an interface's clsact qdisc */
#define RDR_FWD_MAX 256    /* interfaces rdr_forwarding lists; more that forward: -E2BIG */

/* The calling thread's netns's interfaces (not lo) on which it forwards what arrives (IPv4: the
 * device's forwarding setting; IPv6: all.forwarding, then every device): their count, written to
 * ifindexes[0..max), or -errno (-E2BIG: more than max, or RDR_FWD_MAX, forward; interfaces that
 * do not forward count for nothing). */
int rdr_forwarding(int *ifindexes, int max);
/* rdr_forwarding over the NETLINK_ROUTE socket s of that netns. */
int rdr_forwarding_on(int s, int *ifindexes, int max);
/* What one rdr_tc_attach changed on an interface: what rdr_tc_undo takes back. */
struct rdr_tc_made {
	int ifindex;
	int qdisc;               /* 1: the clsact qdisc was made by the call */
	int side[2];             /* ingress [0], egress [1]: 0 untouched, 1 our filter made, 2 one of ours
				  * replaced (by the program and classid below, put back by an undo) */
	int old_fd[2];           /* the replaced filter's program, held open (-1: none) */
	uint32_t old_classid[2]; /* and its classid (its major: whether the qdisc is ours) */
};

/* What held our filters' place when rdr_tc_attach failed with -EEXIST (what = 0: nothing found). */
#define RDR_TC_BLAME_FILTER 1 /* a filter that is not ours at our priority on one side, in ours' place or
			       * beside it (kind, protocol, handle) */
#define RDR_TC_BLAME_QDISC 2  /* a qdisc of another kind where the clsact qdisc goes (an ingress one) */
#define RDR_TC_BLAME_LINK 3   /* (-EPFNOSUPPORT) a link type whose header the tc programs cannot step
			       * over: its ARPHRD_* in protocol */
struct rdr_tc_blame {
	int ifindex;
	int what;                /* RDR_TC_BLAME_*, or 0 */
	int egress;              /* the filter's side */
	uint32_t protocol;       /* the filter's protocol (ETH_P_*, host order) */
	uint32_t handle;         /* the filter's handle (0: not known) */
	char kind[16];           /* the filter's kind, or the qdisc's */
	char ifname[16];         /* the interface's name ("" if it could not be read) */
};

/* Our filters on ifindex (in the calling thread's netns), made or replaced: prog_in on ingress,
 * prog_out on egress, both with classid (the pod's pool slot + 1; RDR_TC_NO_L2 added here for an
 * interface without a link-layer header, -EPFNOSUPPORT for a link type the programs cannot
 * parse, described in *blame), in its clsact qdisc (made if missing; our filters record whether
 * they made it). 0 with what it changed in *made (rdr_tc_undo takes it back; rdr_tc_keep once it
 * stays), or -errno with nothing of this call's left: -EEXIST when something not ours holds our
 * place (a filter at our priority on one side, of any kind or protocol, where ours goes or beside
 * it, or another qdisc where the clsact qdisc goes), described in *blame (if not NULL). */
int rdr_tc_attach(int ifindex, int prog_in, int prog_out, uint32_t classid, struct rdr_tc_made *made,
		  struct rdr_tc_blame *blame);
/* Take back what an rdr_tc_attach made (*made): a filter it made goes, one of ours it replaced is
 * put back, and the clsact qdisc goes if it made it and nothing else is in it. Nothing else of the
 * interface is touched. */
void rdr_tc_undo(struct rdr_tc_made *made);
/* Keep what an rdr_tc_attach made: the programs held for an undo are let go. */
void rdr_tc_keep(struct rdr_tc_made *made);
/* Our filters off ifindex, and the clsact qdisc with them when it is ours (made by our setup, as
 * our filters record) and holds nothing else (a filter or chain not ours): 0 or -errno. */
int rdr_tc_detach(int ifindex);
/* rdr_tc_detach on every interface of the calling thread's netns but lo: how many had ours, or
 * -errno. However many interfaces and qdiscs there are (the list of clsact qdiscs grows). */
int rdr_tc_detach_all(void);
/* One interface's filters of ours: a side without one has program 0. */
struct rdr_tc_filter {
	int ifindex;
	uint32_t prog_in, classid_in, prog_out, classid_out;
	uint32_t others; /* bit 0 ingress, bit 1 egress: a filter not ours at our priority there */
};

/* Our filters in the calling thread's netns: how many interfaces have ours (the first max of them
 * written to out[0..max): call again with room for all when that is more), or -errno. */
int rdr_tc_list(struct rdr_tc_filter *out, int max);

/* BPF_PROG_GET_FD_BY_ID / BPF_MAP_GET_FD_BY_ID: a new fd of the object with that id. */
int rdr_bpf_prog_get_fd_by_id(uint32_t id);
int rdr_bpf_map_get_fd_by_id(uint32_t id);

/* The ids of the maps a program uses (at most max, written to ids): their number. */
int rdr_bpf_prog_map_ids(int prog_fd, uint32_t *ids, uint32_t max);

/* A map's name (BPF_OBJ_NAME_LEN = 16 bytes, NUL-terminated, written to name). */
int rdr_bpf_map_name(int map_fd, char *name);

/* pidfd_getfd(2): a duplicate of another process's fd (needs ptrace rights). */
int rdr_pidfd_getfd(int pidfd, int fd);

/* --- what a pod's netns holds (pod_setup.c) ------------------------------------ */

#define RDR_SCAN_MAX 256 /* addresses of the pod's own a scan holds; more: -E2BIG */
#define RDR_SCAN_OURS 4  /* and of ours (on lo, with our routing protocol: ::6); more: -E2BIG */
#define RDR_SCAN_CAP 260 /* RDR_SCAN_MAX + RDR_SCAN_OURS */

struct rdr_scan_addr {
	int family;   /* 4 or 6 */
	int ifindex;
	uint8_t addr[16]; /* IPv4 in the first 4 bytes */
};

/* The calling thread's netns as the eBPF backend's setup needs it, from one RTM_GETADDR dump. */
struct rdr_netns_scan {
	uint64_t cookie;  /* its netns cookie */
	int v6_on;        /* an IPv6 address exists (::1 at least, unless IPv6 is off) */
	int n;            /* addresses below: loopback aside (IPv6 link-local ones included) */
	int n_ours;       /* of them, on lo with our routing protocol (ours: not counted against
			   * RDR_SCAN_MAX) */
	struct rdr_scan_addr a[RDR_SCAN_CAP];
};

/* Fill sc for the calling thread's netns (a[n..] left as they were), the addresses on lo with
 * routing protocol ours_proto (0: none) being ours: 0 or -errno (-E2BIG: more than RDR_SCAN_MAX
 * of the pod's own, or RDR_SCAN_OURS of ours). */
int rdr_scan_netns(struct rdr_netns_scan *sc, uint8_t ours_proto);

/* A pod's sources (struct pod_policy's src4, src6: what the connect and sendmsg hooks give a socket
 * they send to the proxy): per family f (4, 6) with has[f == 6], the first of the pod's addresses
 * a[0..n) of that family not on lo (ifindex 1) and not IPv6 link-local; and (with has[1]) its first
 * IPv6 link-local address, which its policy holds (ll6) in place of a local6 entry. A field without
 * one is left as it was. The one statement of those choices: the fresh-pod call and the general
 * path (entries.pod_sources). */
void rdr_pod_sources(const struct rdr_scan_addr *a, int n, const int has[2], uint8_t src4[4], uint8_t src6[16],
		     uint8_t ll6[16]);

#define RDR_FAM4 1
#define RDR_FAM6 2

/* May a TCP listener take connections to `port` in the calling thread's netns, for the families
 * fams (RDR_FAM4 | RDR_FAM6), at 127.0.0.1, ::1 or one of the addresses in sc? 1 it may (or can't
 * tell), 0 none does (or no family asked). With tcp_diag (rdr_tcp_diag_ok()) exact sock_diag
 * look-ups, else a bind probe of the port. */
int rdr_inbound_listener_maybe(uint16_t port, int fams, const struct rdr_netns_scan *sc, int tcp_diag);

/* --- policy routes (pod_setup.c) ------------------------------------------------------- */

#define RDR_RT_ROUTE 0 /* `ip route add local default dev OIF table TABLE` */
#define RDR_RT_RULE 1  /* `ip rule add fwmark FWMARK/MASK lookup TABLE pref PRIORITY` */

/* One half of a policy route (redirect.kernel.routes: its rule, or the route the rule leads to)
 * added or deleted, with our routing protocol: the one statement of those messages. */
struct rdr_route_op {
	uint8_t kind;      /* RDR_RT_ROUTE or RDR_RT_RULE */
	uint8_t add;       /* 1: add (none may be there: NLM_F_EXCL), 0: delete */
	uint8_t family;    /* 4 or 6 */
	uint8_t proto;     /* our routing protocol: an added rule or route carries it */
	uint32_t table;
	uint32_t fwmark;   /* a rule's */
	uint32_t mask;
	uint32_t priority;
	int32_t oif;       /* a route's device */
};

#define RDR_ROUTE_OPS_MAX 16

/* The n ops (at most RDR_ROUTE_OPS_MAX) in one netlink batch, in order, over the NETLINK_ROUTE
 * socket s (< 0: one opened in the calling thread's netns): errs[i] is the kernel's answer to the
 * i-th (0 or -errno). 0 once each is answered, else -errno. */
int rdr_route_ops(int s, const struct rdr_route_op *ops, uint32_t n, int *errs);

/* --- the per-pod side's view of the host side ------------------------------------- */

/* The host objects a pod's setup writes through, of one handle on the pinned host programs
 * (redirect/backends/ebpf/host: HostPrograms.native, made once per handle and never written by a
 * call): the maps by fd, the pool's state, the tc programs, and where the pods' links are pinned.
 * All a pod's write knows of the host side. */
struct rdr_host_maps {
	int pods, inventory, ports, cidrs, listeners;
	int lookup_netns, lookup_prog;    /* for a pool program loaded on demand (rdr_ebpf_pool_prog) */
	int slots, free, pool;            /* the pool (redirect/bpf/redirect.h: lookup_slots, _free, _pool) */
	const uint32_t *slot_hint;        /* where to look for an unclaimed slot when none is queued free
					   * (where this process's next batch starts), read at each call */
	int *prog_fds;                    /* RDR_POOL_MAX fds (-1: none) of the pool's programs the handle
					   * keeps open, at most RDR_PROG_CACHE of them (*n_prog_fds): a claim
					   * of a slot there needs no look-up; or NULL */
	int *n_prog_fds;
	int tc_prog_in, tc_prog_out;      /* the host's rdr_tc_ingress, rdr_tc_egress (-1: none) */
	const char *pin_dir;              /* <root>/pods: a pod's link is pinned at <pin_dir>/<cookie>-sk_lookup */
	int pin_dir_fd;                   /* that directory, open (O_PATH): the pin is made relative to it
					   * where the kernel can (no walk of the root's path); or -1 */
	const int *alive;                 /* 0 while the handle is looked over again (the fresh-pod call
					   * backs off); or NULL */
	const char *root;                 /* the handle's root: the fresh-pod call backs off (RDR_POD_STALE)
					   * when $REDIRECT_BPF_ROOT (or its default, default_root) names another */
	const char *default_root;
};

/* --- one pod's entries written as a difference (pod_setup.c) ----------------- */

/* One key of a pod in ports or cidrs (redirect/bpf/abi.h), as its inventory holds it. */
struct rdr_pod_entry {
	uint32_t map;                 /* RDR_INV_PORTS or RDR_INV_CIDRS */
	uint32_t have;                /* already in its map (the pod's previous config has it): not
				       * written, and not removed by an undo */
	uint8_t key[RDR_INV_KEY_MAX]; /* the key, zero-padded */
};

/* What one pod is to have, and what of its previous state goes, on one host handle's maps: the
 * difference the eBPF backend writes, whoever computed it (the fresh-pod call below, for a pod
 * with nothing yet; EbpfBackend.apply for any other). */
struct rdr_pod_write {
	const struct rdr_host_maps *host;
	uint64_t cookie;
	uint64_t netns_ino;           /* the pod netns's inode: kept with its slot claim (the garbage
				       * collection tells a claim of a setup under way by its netns lock) */
	int *pool_low;                /* if not NULL: set to 1 when no slot was queued free (load a batch) */
	const uint8_t *add_v6;        /* if not NULL: this IPv6 address (the intent's ::6) goes on lo as a
				       * /128 of ours first (already there: left, and not removed by an undo) */
	uint8_t addr_proto;           /* its IFA_PROTO */
	uint32_t addr_flags;          /* its IFA_FLAGS */
	int nl;                       /* a NETLINK_ROUTE socket in the pod's netns for that, or -1 (one is
				       * opened when needed) */
	const struct rdr_pod_entry *entries; /* every key the pod is to have, in inventory order */
	uint32_t n_entries;
	uint32_t inv_base;            /* its inventory goes to idx inv_base.. (never the old one's) */
	int listener_fd[2];           /* the proxy's inbound listeners already open, IPv4, IPv6; -1: none */
	int link_netns;               /* >= 0: claim a pool slot for the pod (its sk_lookup program), link it
				       * on this netns, pinned at <host->pin_dir>/<cookie>-sk_lookup */
	const struct pod_policy *policy; /* its inventory fields are set here; written last: it
					  * switches capture on (or over to the new config) */
	uint64_t update_flags;        /* BPF_NOEXIST: nothing may be there yet (a leftover fails the call
				       * with -EEXIST, everything undone); or BPF_ANY */
	/* Once the policy is in, what the previous config had and this one has not: */
	const struct rdr_pod_entry *stale;
	uint32_t n_stale;
	const struct inv_key *old_inv; /* the previous inventory's keys */
	uint32_t n_old_inv;
	int drop_listeners;           /* no inbound capture: the listener entries go too */
	int new_pod;                  /* the pod had no policy: an undo removes its listener entries too */
	/* Our tc filters (tc_filter.c) to put on these interfaces of the netns the caller is in, after
	 * the link and before the policy, with the pod's slot (the one claimed here, else slot_now): */
	const int *tc_ifs;
	uint32_t n_tc;
	struct rdr_tc_blame *tc_blame; /* if not NULL: what held our place when putting them on failed */
	int32_t slot_now;             /* the slot of the pod's link when it has one (link_netns < 0) */
	struct rdr_pod_call *call;    /* a fresh pod's call, whose steps it times (RDR_STEP_*), or NULL */
};

#define RDR_PROG_CACHE 256

/* Keep prog (pool slot s's program) in a host handle's cache (fds, *n_fds: see prog_fds above)
 * while it has room and none is kept for s: 1 kept (the cache owns it now), 0 not (the caller
 * closes it). Threads may call it at once. */
int rdr_prog_cache_put(int *fds, int *n_fds, uint32_t s, int prog);

/* Write w: the address, the inventory, the new keys, the listeners, the link, then the policy; then
 * delete the stale keys and the old inventory. A failure before the policy is in undoes everything written,
 * in reverse (listener entries only for a new pod: an existing one's were there before; a claimed
 * slot is released). REDIRECT_FAULT=ebpf.before_entries|ebpf.after_claim|ebpf.before_policy in the environment fails it
 * there (with ":kill" appended: SIGKILL, as a crash would). 0, RDR_POD_FAULT (undone), or -errno
 * (undone). */
int rdr_ebpf_pod_write(const struct rdr_pod_write *w);

/* --- the eBPF backend's setup of a fresh pod (pod_setup.c) ----------------- */

#define RDR_POD_SLOW 1     /* not a fresh pod (or can't tell): nothing changed, take the general path */
#define RDR_POD_BUSY 2     /* another thread or process holds the netns lock: nothing changed */
#define RDR_POD_FAULT 3    /* REDIRECT_FAULT reached (fault injection for tests): everything undone, but at
                            * ebpf.before_fwmark_accept (after the policy) */
#define RDR_POD_STRANDED 4 /* could not setns back to the thread's own netns */
#define RDR_POD_STALE 5    /* a host pin changed (watch_fd), *alive is 0, or the root is another: nothing
                            * changed, look again */
#define RDR_POD_FWMARK 6   /* set up, but net.ipv4.tcp_fwmark_accept could not be turned on (errno in the
                            * call's err): the policy records it ours, so the next setup does it */

#define RDR_POD_ROUTE_OPS_MAX 8 /* a fresh pod's policy routes (two ops each); more go the general way */

/* What the eBPF lowering wants in a pod of one kind (redirect/backends/ebpf/pod/fresh.py): the
 * entries keyed with netns 0, for the call to put the pod's cookie in. */
struct rdr_pod_set {
	const struct pod_policy *policy;  /* inventory fields zero */
	const struct port_key *ports;
	uint32_t n_ports;
	const struct cidr_key *cidrs;     /* the plan's addresses (add) among them */
	uint32_t n_cidrs;
	struct cidr_key local[2];         /* the key of one of the pod's own IPv4 [0], IPv6 [1] addresses,
					   * its netns and addr to fill in */
	int has_local[2];                 /* (0: that family is not captured) */
	int v6;                           /* IPv6 is captured */
	int n_add;                        /* 1: the plan adds add/128 on lo (::6), 0: nothing */
	uint8_t add[16];
	/* The config's policy routes in such a pod, as their adds in order (each route, then its rule):
	 * added before anything else, removed again (in reverse) if the pod's write fails. */
	struct rdr_route_op routes[RDR_POD_ROUTE_OPS_MAX];
	uint32_t n_routes;
	int fwmark_accept;                /* its proxy's transparent connections are answered by their
					   * mark: net.ipv4.tcp_fwmark_accept must be on (read before any
					   * change; turned on after the policy, which records it ours when
					   * it was off) */
};

#define RDR_OURS_V6_MAX 4

/* What a config writes for any fresh pod on one host handle's maps: made once, shared by
 * threads (never written by the call). */
struct rdr_pod_req {
	const struct rdr_host_maps *host;
	uint16_t inbound_port;      /* 0: no inbound capture (no listener check) */
	uint8_t addr_proto;         /* IFA_PROTO of the address we add */
	uint32_t addr_flags;        /* its IFA_FLAGS */
	/* What the config writes in a pod by [IPv6 on in its netns][it has an IPv6 address of its own,
	 * one that is not among ours_v6]: */
	struct rdr_pod_set sets[2][2];
	uint8_t ours_v6[RDR_OURS_V6_MAX][16]; /* the IPv6 addresses a plan may add (redirect.kernel.routes.own_ipv6:
					       * never the pod's own; on lo, maybe ours from before) */
	uint32_t n_ours_v6;
	int tcp_diag;               /* rdr_tcp_diag_ok(): look listeners up over sock_diag, not by a
				     * bind probe of the inbound port */
	uint64_t host_netns_ino[2]; /* the host's netns inodes (redirect.kernel.netns.host_netns_inodes(), 0:
				     * none): the call backs off for them and for the caller's own, which
				     * redirect.setup refuses (or allows) on its general path */
	int nf_marks_fd;            /* the run dir's netfilter marks (redirect.kernel.locks.netfilter_marks), or -1 */
	int nf_marks_ready;         /* they are complete (every netns that may hold netfilter capture of
				     * ours is marked): a netns without a mark holds none; 0: always look */
	int tc_forwarded;           /* the config's capture takes what the pod forwards: our tc filters go
				     * on the interfaces it forwards on (rdr_forwarding) */
	int owner_ids;              /* the config matches owner ids (proxy uids/gids, owner groups): the
				     * call backs off for a netns a user namespace of its own owns, whose
				     * ids the general path translates (rdr_netns_id_maps) */
};

/* The steps of a fresh pod's setup (rdr_ebpf_pod_add), each timed (rdr_pod_call.step_ns): where the
 * call's time goes. Their names, in this order: rdr_pod_step_names. */
#define RDR_STEP_OPEN 0       /* the netns file checked and opened, its lock taken */
#define RDR_STEP_ENTER 1      /* the thread's own netns kept, the pod's entered */
#define RDR_STEP_SCAN 2       /* a netlink socket there, the netns cookie, the address dump */
#define RDR_STEP_FRESH 3      /* no policy of ours for the cookie, no netfilter capture of ours */
#define RDR_STEP_LISTENER 4   /* the entries made, the proxy's inbound listener looked up */
#define RDR_STEP_SYSCTL 5     /* net.ipv4.tcp_fwmark_accept opened and read, then written */
#define RDR_STEP_FORWARDING 6 /* the interfaces the pod forwards on (the netconf dump) */
#define RDR_STEP_ROUTES 7     /* the policy routes added */
#define RDR_STEP_MAPS 8       /* the intent's address on lo, the inventory and the entries written */
#define RDR_STEP_LINK 9       /* a pool slot claimed, the sk_lookup link made and pinned */
#define RDR_STEP_TC 10        /* our tc filters on the interfaces the pod forwards on */
#define RDR_STEP_POLICY 11    /* the policy written (capture on) */
#define RDR_STEP_LEAVE 12     /* sockets closed, the thread back in its own netns, the lock released */
#define RDR_STEPS 13
extern const char *const rdr_pod_step_names[13];

/* The name of a pod's sk_lookup link pin in the pods' pin dir: its netns cookie in decimal, then
 * this. The one statement of it: redirect.backends.ebpf.host.pods reads it from here. */
extern const char rdr_pod_link_suffix[];

/* What one call found and did. */
struct rdr_pod_call {
	uint64_t cookie;            /* the netns cookie */
	int v6;                     /* IPv6 is captured */
	int pool_low;               /* no pool slot was queued free (rdr_pod_write): the caller loads a batch */
	uint64_t wall_ns;           /* the call's wall time */
	int err;                    /* RDR_POD_FWMARK: the write's -errno */
	uint64_t step_at;           /* when the step under way started (CLOCK_MONOTONIC ns) */
	uint32_t step_ns[13];       /* the time of each step (RDR_STEP_*), 0 for one not taken */
	struct rdr_tc_blame tc_blame; /* what held our tc filters' place, when that failed the call */
};

/* 1 if sock_diag answers for TCP sockets here (exact look-ups of listeners work), else 0. */
int rdr_tcp_diag_ok(void);

/* A netlink socket of protocol in the calling thread's netns, connected to the kernel: the one way
 * the native files make one (netlink.c), so only the kernel's answers reach them. fd or -errno. */
int rdr_nl_socket(int protocol);

/* The netns lock (redirect.kernel.locks): an OFD write lock (lock 1) or its release (lock 0) of the
 * byte at the netns inode ino in the lock file open as fd. Not waiting: -EAGAIN (or -EACCES)
 * while another open of the file holds it, another thread's as well as another process's. */
int rdr_netns_lock(int fd, uint64_t ino, int lock);

/* Set up a fresh pod: the netns at netns_path (opened here), or netns_fd when it is NULL.
 * watch_fd: an inotify fd on the host pin dirs (rdr_watch_add), or -1. lock_fd: the calling
 * thread's own open of the netns lock file: the netns lock (rdr_netns_lock) is held throughout
 * (-1: none, and the call backs off: threads could not be told apart).
 * A netns that is the host's (r->host_netns_ino, or the caller's own) or that may hold netfilter
 * capture of ours (marked, and with a netfilter table: rdr_netfilter_present) is not a fresh pod.
 * The config's policy routes go in first (fresh: none of ours there yet), removed again if the
 * write fails; net.ipv4.tcp_fwmark_accept, when the config needs it, is read before any change and
 * turned on after the policy (RDR_POD_FWMARK if that write fails).
 * REDIRECT_FAULT=ebpf.before_entries|ebpf.after_claim|ebpf.before_policy in the environment fails it
 * there, everything undone; ebpf.before_fwmark_accept after the policy (the pod set up, the sysctl
 * not turned on).
 * 0: the pod is set up (c filled in); RDR_POD_*; or -errno of what failed (everything undone). */
int rdr_ebpf_pod_add(const struct rdr_pod_req *r, struct rdr_pod_call *c, const char *netns_path, int netns_fd,
		     int watch_fd, int lock_fd);

/* --- netfilter in the calling thread's netns (netfilter_probe.c) ------------- */

/* 1 if the calling thread's netns has any nf_tables table or legacy IPv4 x_tables table, 0 if
 * none, -errno if it can't tell. Creates nothing. */
int rdr_netfilter_present(void);

/* One nf_tables table or chain of the calling thread's netns as the kernel describes it: what
 * iptables-nft's setup and teardown need of one (redirect.backends.iptables), read without
 * libnftables printing its rules (which makes libxtables write warnings to stderr). */
#define RDR_NFT_COMMENT_MAX 256 /* the kernel keeps at most 256 bytes of user data */
struct rdr_nft_obj {
	int64_t flags;    /* NFTA_TABLE_FLAGS (NFT_TABLE_F_*), NFTA_CHAIN_FLAGS (NFT_CHAIN_*); -1: none sent */
	int64_t use;      /* a table's NFTA_TABLE_USE: its chains, sets, objects and flowtables; a chain's
			   * NFTA_CHAIN_USE: the jumps to it (not its rules); -1: none sent */
	int64_t policy;   /* a chain's NFTA_CHAIN_POLICY (NF_ACCEPT 1, NF_DROP 0); -1: none (not a base chain) */
	int hook;         /* a chain: 1 if it is a base chain (NFTA_CHAIN_HOOK) */
	int rules;        /* a chain: 1 if it holds a rule */
	int comment_len;  /* the comment's length, -1: none (no user data, or not as nft reads a comment) */
	char comment[RDR_NFT_COMMENT_MAX]; /* the comment, NUL-terminated (libnftnl's user data TLV of
					    * type 0, as nft prints it) */
};

/* The table `table` of family (4: ip, 6: ip6), or its chain `chain`, into *out: 0, -ENOENT if
 * there is none, -ENAMETOOLONG, or -errno. Creates nothing. */
int rdr_nft_table(int family, const char *table, struct rdr_nft_obj *out);
int rdr_nft_chain(int family, const char *table, const char *chain, struct rdr_nft_obj *out);
