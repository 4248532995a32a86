/* redirect native helpers: the few syscalls Python 3.11 and bcc do not expose.
 * Every function returns >= 0 on success and -errno on failure, so the Python
 * side can raise OSError with the right code without reading errno itself. */
#include <stdint.h>

/* setns(2) on the calling thread. nstype 0 or CLONE_NEWNET. */
int rdr_setns(int fd, int nstype);

/* The network namespace cookie (SO_NETNS_COOKIE) of the netns a socket lives in.
 * Written to *cookie. */
int rdr_sock_netns_cookie(int sockfd, uint64_t *cookie);

/* The cookie of the netns behind an open netns fd: enters it on this thread,
 * opens a socket, reads the cookie, returns. Leaves the thread where it was. */
int rdr_netns_cookie(int netns_fd, uint64_t *cookie);
