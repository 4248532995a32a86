/* rdrt_client: the application side of the data-path benchmark.
 *
 *   rdrt_client crr  ADDR PORT MAX_COUNT MAX_SECONDS MSG_BYTES
 *   rdrt_client bulk ADDR PORT MAX_BYTES MAX_SECONDS CHUNK_BYTES
 *   rdrt_client rr   ADDR PORT MAX_COUNT MAX_SECONDS MSG_BYTES
 *
 * crr: sequential connect + MSG_BYTES request + MSG_BYTES echoed reply + close, until
 * MAX_COUNT connections or MAX_SECONDS, whichever first. Sockets close with SO_LINGER 0 (a
 * reset) so no TIME_WAIT piles up and ephemeral ports never run out; every case pays the same.
 * bulk: one connection streaming CHUNK_BYTES writes to the sink until MAX_BYTES or MAX_SECONDS.
 * rr: one connection, then MSG_BYTES request + MSG_BYTES echoed reply, again and again, until
 * MAX_COUNT round trips or MAX_SECONDS: the latency of an established connection.
 * Prints one JSON object on stdout. Stops early after 100 errors.
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
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static socklen_t make_addr(const char *addr, int port, struct sockaddr_storage *ss) {
    memset(ss, 0, sizeof *ss);
    if (strchr(addr, ':')) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons((uint16_t)port);
        if (inet_pton(AF_INET6, addr, &a->sin6_addr) != 1) return 0;
        return sizeof *a;
    }
    struct sockaddr_in *a = (struct sockaddr_in *)ss;
    a->sin_family = AF_INET;
    a->sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, addr, &a->sin_addr) != 1) return 0;
    return sizeof *a;
}

/* Blocking reads that returned EAGAIN (a socket paired in a sockmap may, when woken without
 * data: docs/kernel-facts.md); retried, and reported. */
static long eagains;

static int read_full(int fd, char *p, size_t n) {
    while (n > 0) {
        ssize_t r = read(fd, p, n);
        if (r <= 0) {
            if (r < 0 && errno == EINTR) continue;
            if (r < 0 && errno == EAGAIN) { eagains++; continue; }
            return -1;
        }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

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

static int crr(const struct sockaddr_storage *ss, socklen_t len, long max_count, double max_s, long msg) {
    uint64_t *lat = calloc((size_t)max_count, sizeof *lat);
    char *out = malloc((size_t)msg), *in = malloc((size_t)msg);
    if (!lat || !out || !in) { fprintf(stderr, "rdrt_client: out of memory\n"); return 1; }
    memset(out, 'x', (size_t)msg);
    struct linger lg = {1, 0};
    int one = 1;
    long n = 0, errors = 0;
    const char *last_error = "";
    uint64_t start = now_ns(), deadline = start + (uint64_t)(max_s * 1e9);
    while (n < max_count && errors < 100) {
        uint64_t t0 = now_ns();
        if (t0 >= deadline) break;
        int s = socket(ss->ss_family, SOCK_STREAM, 0);
        if (s < 0) { errors++; last_error = "socket"; continue; }
        setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (connect(s, (const struct sockaddr *)ss, len) < 0) { errors++; last_error = "connect"; close(s); continue; }
        if (write_all(s, out, (size_t)msg) < 0 || read_full(s, in, (size_t)msg) < 0) {
            errors++; last_error = "request"; close(s); continue;
        }
        setsockopt(s, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
        close(s);
        lat[n++] = now_ns() - t0;
    }
    double secs = (double)(now_ns() - start) / 1e9;
    qsort(lat, (size_t)n, sizeof *lat, cmp_u64);
    double p50 = n ? (double)lat[n / 2] / 1e3 : 0, p99 = n ? (double)lat[(n * 99) / 100] / 1e3 : 0;
    double mn = n ? (double)lat[0] / 1e3 : 0;
    printf("{\"mode\": \"crr\", \"count\": %ld, \"seconds\": %.6f, \"conn_per_s\": %.1f, \"min_us\": %.2f, "
           "\"p50_us\": %.2f, \"p99_us\": %.2f, \"msg_bytes\": %ld, \"errors\": %ld, \"last_error\": \"%s\", "
           "\"eagains\": %ld}\n", n, secs, secs > 0 ? (double)n / secs : 0, mn, p50, p99, msg, errors, last_error, eagains);
    return n > 0 ? 0 : 1;
}

static int rr(const struct sockaddr_storage *ss, socklen_t len, long max_count, double max_s, long msg) {
    uint64_t *lat = calloc((size_t)max_count, sizeof *lat);
    char *out = malloc((size_t)msg), *in = malloc((size_t)msg);
    if (!lat || !out || !in) { fprintf(stderr, "rdrt_client: out of memory\n"); return 1; }
    memset(out, 'r', (size_t)msg);
    int one = 1;
    int s = socket(ss->ss_family, SOCK_STREAM, 0);
    if (s < 0 || connect(s, (const struct sockaddr *)ss, len) < 0) { perror("connect"); return 1; }
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    long n = 0;
    uint64_t start = now_ns(), deadline = start + (uint64_t)(max_s * 1e9);
    while (n < max_count) {
        uint64_t t0 = now_ns();
        if (t0 >= deadline) break;
        if (write_all(s, out, (size_t)msg) < 0 || read_full(s, in, (size_t)msg) < 0) { perror("rr"); return 1; }
        lat[n++] = now_ns() - t0;
    }
    double secs = (double)(now_ns() - start) / 1e9;
    close(s);
    qsort(lat, (size_t)n, sizeof *lat, cmp_u64);
    double p50 = n ? (double)lat[n / 2] / 1e3 : 0, p99 = n ? (double)lat[(n * 99) / 100] / 1e3 : 0;
    double mn = n ? (double)lat[0] / 1e3 : 0;
    printf("{\"mode\": \"rr\", \"count\": %ld, \"seconds\": %.6f, \"rr_per_s\": %.1f, \"min_us\": %.2f, "
           "\"p50_us\": %.2f, \"p99_us\": %.2f, \"msg_bytes\": %ld, \"eagains\": %ld}\n",
           n, secs, secs > 0 ? (double)n / secs : 0, mn, p50, p99, msg, eagains);
    return n > 0 ? 0 : 1;
}

static int bulk(const struct sockaddr_storage *ss, socklen_t len, long max_bytes, double max_s, long chunk) {
    char *out = malloc((size_t)chunk);
    if (!out) return 1;
    memset(out, 'y', (size_t)chunk);
    out[0] = 'S';
    int s = socket(ss->ss_family, SOCK_STREAM, 0);
    if (s < 0 || connect(s, (const struct sockaddr *)ss, len) < 0) { perror("connect"); return 1; }
    uint64_t start = now_ns(), deadline = start + (uint64_t)(max_s * 1e9);
    long sent = 0;
    while (sent < max_bytes && now_ns() < deadline) {
        if (write_all(s, out, (size_t)chunk) < 0) { perror("write"); return 1; }
        sent += chunk;
        out[0] = 'y';
    }
    shutdown(s, SHUT_WR);
    uint64_t got = 0;
    if (read_full(s, (char *)&got, sizeof got) < 0) { perror("read"); return 1; }
    double secs = (double)(now_ns() - start) / 1e9;
    close(s);
    printf("{\"mode\": \"bulk\", \"bytes\": %ld, \"acked_bytes\": %llu, \"seconds\": %.6f, \"gbit_per_s\": %.3f, "
           "\"eagains\": %ld}\n", sent, (unsigned long long)got, secs, secs > 0 ? (double)got * 8 / secs / 1e9 : 0, eagains);
    return got == (uint64_t)sent ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s crr|rr|bulk ADDR PORT MAX_COUNT|MAX_BYTES MAX_SECONDS MSG|CHUNK_BYTES\n", argv[0]);
        return 2;
    }
    struct sockaddr_storage ss;
    socklen_t len = make_addr(argv[2], atoi(argv[3]), &ss);
    long max = atol(argv[4]), size = atol(argv[6]);
    double max_s = atof(argv[5]);
    if (!len || max <= 0 || size <= 0 || max_s <= 0 || max_s > 600) {
        fprintf(stderr, "rdrt_client: bad arguments\n");
        return 2;
    }
    if (!strcmp(argv[1], "crr")) return crr(&ss, len, max, max_s, size);
    if (!strcmp(argv[1], "rr")) return rr(&ss, len, max, max_s, size);
    if (!strcmp(argv[1], "bulk")) return bulk(&ss, len, max, max_s, size);
    fprintf(stderr, "rdrt_client: unknown mode %s\n", argv[1]);
    return 2;
}
