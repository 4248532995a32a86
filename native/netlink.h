/* The native files' one netlink client (netlink.c): a socket, a request with its attributes, and
 * the four ways an answer comes (an ack or a reply, a dump, the answers of a batch). Not part of
 * the Python interface (redirect_native.h is). Sequence numbers are the client's: each exchange
 * takes fresh ones from one counter, so a socket reused for several never confuses their answers. */
#ifndef RDR_NETLINK_H
#define RDR_NETLINK_H

#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <stddef.h>
#include <stdint.h>

/* A netlink socket of protocol (NETLINK_ROUTE, NETLINK_SOCK_DIAG, NETLINK_NETFILTER) in the
 * calling thread's netns, close-on-exec: the fd or -errno. */
int rdr_nl_socket(int protocol);

/* One request being built: its header, its fixed body, then its attributes. */
#define RDR_NLREQ_MAX 320
struct rdr_nlreq {
	union {
		struct nlmsghdr h;
		char raw[RDR_NLREQ_MAX];
	};
} __attribute__((aligned(8)));

/* Start r as a request of type with flags (NLM_F_REQUEST is added) and the fixed body body[0..len)
 * (NULL: zeros); the body, to fill in further. */
void *rdr_nl_start(struct rdr_nlreq *r, uint16_t type, uint16_t flags, const void *body, size_t len);

/* An attribute appended to r (data may be NULL for a nest, closed by rdr_nl_nest_end); the
 * requests here are far smaller than RDR_NLREQ_MAX, and one that would not fit is left as it was. */
struct rtattr *rdr_nl_attr(struct rdr_nlreq *r, unsigned short type, const void *data, size_t len);
void rdr_nl_nest_end(struct rdr_nlreq *r, struct rtattr *nest);

/* Netlink answers, several messages in one call (recvmmsg): waits for the first, then takes what
 * is queued, up to n (at most RDR_NL_RECV_MAX) datagrams of at most `each` bytes, the i-th at
 * buf + i * each with its length in lens[i] (-EMSGSIZE: it did not fit). A dump's next batch is
 * made while its last one is read, so one call takes a short dump and its end. The count, or
 * -errno. */
#define RDR_NL_RECV_MAX 8
int rdr_nl_recv(int s, char *buf, size_t each, int n, int *lens);

/* Send req and wait for its answer: with reply, the first message answering it is copied there
 * (a get; -EMSGSIZE if it is larger than reply_len), else its ack is asked for and awaited. 0, or
 * the kernel's error (-errno). */
int rdr_nl_talk(int s, struct nlmsghdr *req, char *reply, size_t reply_len);

/* Send req as a dump request and pass each message of its answer to on(arg, message) until the
 * end, reading at most two datagrams of `each` bytes a call into buf (2 * each bytes). 0 at the
 * end; a value on returned that is not 0 (negative: an error; positive: enough was seen, the rest
 * is not read); the kernel's error; or -errno (-EMSGSIZE: a datagram did not fit). -EINTR: the
 * whole answer was read, but the kernel flagged it inconsistent (NLM_F_DUMP_INTR: what it lists
 * changed while it was dumped, so an object may be missing from it, or there twice): see
 * rdr_nl_dump_whole. */
int rdr_nl_dump(int s, struct nlmsghdr *req, char *buf, size_t each,
		int (*on)(void *, const struct nlmsghdr *), void *arg);

/* rdr_nl_dump again while it answers -EINTR, at most RDR_NL_DUMP_TRIES dumps in all, reset(arg)
 * (if not NULL) before each: what on() gathers comes from one dump the kernel did not flag. */
int rdr_nl_dump_whole(int s, struct nlmsghdr *req, char *buf, size_t each,
		      int (*on)(void *, const struct nlmsghdr *), void (*reset)(void *), void *arg);
#define RDR_NL_DUMP_TRIES 8

/* Send the n requests in msgs (len bytes, one after another, each answered in a datagram of its
 * own) in one call, and read their answers, at most RDR_NL_RECV_MAX a call into buf (room for
 * that many, or n if fewer, datagrams of `each` bytes): answers[i] is the kernel's error (0: an
 * ack) when the i-th is answered with NLMSG_ERROR, 1 when with another message (a reply; cut
 * short to `each` bytes, it still counts). 0 once every request is answered, else -errno or
 * -EPROTO (the missing answers stay -EPROTO). */
int rdr_nl_batch(int s, void *msgs, size_t len, int n, int *answers, char *buf, size_t each);

#endif
