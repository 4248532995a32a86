/* Netlink helpers the native files share (not part of the Python interface: redirect_native.h is). */
#ifndef RDR_NETLINK_H
#define RDR_NETLINK_H

#include <linux/netlink.h>
#include <stddef.h>
#include <stdint.h>

/* Netlink answers, several messages in one call (recvmmsg): waits for the first, then takes what
 * is queued, up to n (at most RDR_NL_RECV_MAX) datagrams of at most `each` bytes, the i-th at
 * buf + i * each with its length in lens[i] (-EMSGSIZE: it did not fit). A dump's next batch is
 * made while its last one is read, so one call takes a short dump and its end. The count, or
 * -errno. */
#define RDR_NL_RECV_MAX 8
int rdr_nl_recv(int s, char *buf, size_t each, int n, int *lens);

/* Send the dump request req (len bytes, with sequence number seq) and pass each message of its
 * answer to on(arg, message) until the end, reading at most two datagrams of `each` bytes a call
 * into buf (2 * each bytes): 0, the first negative value on returned, the kernel's error, or
 * -errno (-EMSGSIZE: a datagram did not fit). */
int rdr_nl_dump(int s, const void *req, size_t len, uint32_t seq, char *buf, size_t each,
		int (*on)(void *, const struct nlmsghdr *), void *arg);

#endif
