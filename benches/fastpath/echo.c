/* rdrt_echo: the stand-in proxy of the data-path benchmark.
 *
 *   rdrt_echo PORT LIFETIME_S
 *
 * Listens on [::]:PORT (dual-stack) and serves one connection at a time (the client is
 * sequential): a connection whose first byte is 'S' is a bulk sink (bytes are counted and
 * discarded; at EOF the count is sent back as 8 bytes); any other connection is echoed until
 * EOF or reset. It never connects onward: the connection-rate figure is the cost of reaching
 * the proxy, which is what capture changes. It prints "ready" once listening, and exits after
 * LIFETIME_S seconds at the latest (alarm), so it can never outlive the benchmark.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static char buf[1 << 17];

static int write_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* A blocking read; EAGAIN (which a socket paired in a sockmap may return when woken without data,
 * docs/kernel-facts.md) is retried. */
static ssize_t read_some(int c) {
    ssize_t n;
    do n = read(c, buf, sizeof buf);
    while (n < 0 && (errno == EAGAIN || errno == EINTR));
    return n;
}

static void serve(int c) {
    ssize_t n = read_some(c);
    if (n <= 0) return;
    if (buf[0] == 'S') {
        uint64_t total = (uint64_t)n;
        while ((n = read_some(c)) > 0) total += (uint64_t)n;
        (void)write_all(c, (const char *)&total, sizeof total);
        return;
    }
    do {
        if (write_all(c, buf, (size_t)n) < 0) return;
    } while ((n = read_some(c)) > 0);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s PORT LIFETIME_S\n", argv[0]);
        return 2;
    }
    int port = atoi(argv[1]);
    unsigned lifetime = (unsigned)atoi(argv[2]);
    if (port <= 0 || port > 65535 || lifetime == 0) {
        fprintf(stderr, "rdrt_echo: bad PORT or LIFETIME_S\n");
        return 2;
    }
    alarm(lifetime);
    int s = socket(AF_INET6, SOCK_STREAM, 0);
    if (s < 0) { perror("socket"); return 1; }
    int one = 1, zero = 0;
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    struct sockaddr_in6 a;
    memset(&a, 0, sizeof a);
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons((uint16_t)port);
    if (bind(s, (struct sockaddr *)&a, sizeof a) < 0) { perror("bind"); return 1; }
    if (listen(s, 4096) < 0) { perror("listen"); return 1; }
    printf("ready\n");
    fflush(stdout);
    for (;;) {
        int c = accept(s, NULL, NULL);
        if (c < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            perror("accept");
            return 1;
        }
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        serve(c);
        close(c);
    }
}
