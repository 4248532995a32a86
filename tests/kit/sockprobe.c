/* sockprobe: what an application sees of a TCP connection, case by case, on real sockets.
 *
 *   sockprobe LISTEN_PORT TARGET_ADDR TARGET_PORT CASE...
 *
 * Listens on [::]:LISTEN_PORT (dual-stack, as squid or Envoy do) and, for each case, connects to
 * TARGET_ADDR:TARGET_PORT, which capture (or nothing) must deliver to that listener: the
 * connecting socket stands for the app, the accepted one for the proxy. Each case prints one
 * JSON object of what it observed; the caller judges it. Cases: sizes, sendfile, splice_send,
 * splice_recv, peek, fionread, waitall, halfclose, close_unread, epoll, slow_reader,
 * blocking_read, blocking_read_halfclose, stress (1000 concurrent connections of random sizes, checksummed). Every wait
 * is bounded (alarm per case); a hung case is reported by the parent as {"case": ..., "hung": 1}.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int lfd;
static struct sockaddr_storage target;
static socklen_t target_len;

static void die(const char *what) {
    printf("{\"error\": \"%s: %s\"}\n", what, strerror(errno));
    exit(2);
}

/* The app's connection and the proxy's accepted end of it. */
static void pair(int *c, int *s) {
    *c = socket(target.ss_family, SOCK_STREAM, 0);
    if (*c < 0 || connect(*c, (struct sockaddr *)&target, target_len)) die("connect");
    struct pollfd pf = {lfd, POLLIN, 0};
    if (poll(&pf, 1, 5000) != 1) die("accept: nothing arrived");
    *s = accept(lfd, NULL, NULL);
    if (*s < 0) die("accept");
}

static uint64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

static ssize_t readn(int fd, void *b, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)b + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -errno;
        if (r == 0) break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

static int writen(int fd, const void *b, size_t n) {
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, (const char *)b + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return -errno;
        done += (size_t)w;
    }
    return 0;
}

static void fill(unsigned char *b, size_t n, uint32_t seed) {
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        b[i] = (unsigned char)(seed >> 16);
    }
}

/* ---- the cases ---- */

struct sized_writer { int fd; const unsigned char *buf; const size_t *sizes; int n; int err; };
static void *write_sizes(void *a) {
    struct sized_writer *w = a;
    size_t off = 0;
    for (int i = 0; i < w->n && !w->err; i++) {
        w->err = writen(w->fd, w->buf + off, w->sizes[i]);
        off += w->sizes[i];
    }
    shutdown(w->fd, SHUT_WR);
    return NULL;
}

/* Every write size from 1 to 4096 bytes, then large ones up to 16 MB, on one connection. */
static void c_sizes(void) {
    static size_t sizes[4096 + 9];
    int n = 0;
    size_t total = 0;
    for (int i = 1; i <= 4096; i++) sizes[n++] = (size_t)i;
    size_t big[] = {65535, 65536, 65537, 131072, 262143, 1 << 20, (1 << 20) + 1, 4 << 20, 16 << 20};
    for (unsigned i = 0; i < sizeof big / sizeof *big; i++) sizes[n++] = big[i];
    for (int i = 0; i < n; i++) total += sizes[i];
    unsigned char *buf = malloc(total), *in = malloc(total + 1);
    if (!buf || !in) die("malloc");
    fill(buf, total, 7);
    int c, s;
    pair(&c, &s);
    struct sized_writer w = {c, buf, sizes, n, 0};
    pthread_t th;
    pthread_create(&th, NULL, write_sizes, &w);
    ssize_t got = readn(s, in, total + 1);
    pthread_join(th, NULL);
    printf("{\"case\": \"sizes\", \"sent\": %zu, \"got\": %zd, \"intact\": %d, \"werr\": %d}\n", total, got,
           got == (ssize_t)total && !memcmp(buf, in, total), w.err);
    free(buf); free(in); close(c); close(s);
}

struct sf { int fd, file; size_t n, sent; };
static void *send_file(void *a) {
    struct sf *x = a;
    off_t off = 0;
    while (x->sent < x->n) {
        ssize_t r = sendfile(x->fd, x->file, &off, x->n - x->sent);
        if (r <= 0) break;
        x->sent += (size_t)r;
    }
    return NULL;
}

static void c_sendfile(void) {
    char path[] = "/tmp/rdrt-sockprobe-XXXXXX";
    int f = mkstemp(path);
    if (f < 0) die("mkstemp");
    unlink(path);
    size_t n = 3 << 20;
    unsigned char *buf = malloc(n), *in = malloc(n);
    fill(buf, n, 11);
    if (writen(f, buf, n)) die("write file");
    int c, s;
    pair(&c, &s);
    struct sf x = {c, f, n, 0};
    pthread_t th;
    pthread_create(&th, NULL, send_file, &x);
    ssize_t got = readn(s, in, n);
    pthread_join(th, NULL);
    printf("{\"case\": \"sendfile\", \"sent\": %zu, \"got\": %zd, \"intact\": %d}\n", x.sent, got,
           got == (ssize_t)n && !memcmp(buf, in, n));
    free(buf); free(in); close(f); close(c); close(s);
}

struct pw { int fd; const unsigned char *m; size_t n; };
static void *pipe_writer(void *a) {
    struct pw *x = a;
    writen(x->fd, x->m, x->n);
    return NULL;
}

/* The app splices a pipe into its socket. */
static void c_splice_send(void) {
    static unsigned char msg[200000], in[200000];
    fill(msg, sizeof msg, 13);
    int p[2];
    if (pipe(p)) die("pipe");
    int c, s;
    pair(&c, &s);
    struct pw x = {p[1], msg, sizeof msg};
    pthread_t th;
    pthread_create(&th, NULL, pipe_writer, &x);
    size_t spl = 0;
    while (spl < sizeof msg) {
        ssize_t r = splice(p[0], NULL, c, NULL, sizeof msg - spl, 0);
        if (r <= 0) break;
        spl += (size_t)r;
    }
    ssize_t got = readn(s, in, sizeof msg);
    pthread_join(th, NULL);
    printf("{\"case\": \"splice_send\", \"spliced\": %zu, \"got\": %zd, \"intact\": %d}\n", spl, got,
           got == (ssize_t)sizeof msg && !memcmp(msg, in, sizeof msg));
    close(p[0]); close(p[1]); close(c); close(s);
}

/* The proxy splices its socket into a pipe (as Go's io.Copy between TCP connections does):
 * non-blocking, waiting in poll, for at most 2 s. */
static void c_splice_recv(void) {
    static unsigned char msg[100000], in[100000];
    fill(msg, sizeof msg, 17);
    int p[2];
    if (pipe(p)) die("pipe");
    fcntl(p[0], F_SETPIPE_SZ, 1 << 20);
    int c, s;
    pair(&c, &s);
    fcntl(s, F_SETFL, O_NONBLOCK);
    if (writen(c, msg, sizeof msg)) die("write");
    size_t tot = 0;
    long eagain = 0;
    uint64_t end = now_ms() + 2000;
    while (tot < sizeof msg && now_ms() < end) {
        struct pollfd pf = {s, POLLIN, 0};
        if (poll(&pf, 1, 200) <= 0) continue;
        ssize_t r = splice(s, NULL, p[1], NULL, sizeof msg - tot, SPLICE_F_NONBLOCK);
        if (r < 0 && errno == EAGAIN) { eagain++; usleep(1000); continue; }
        if (r <= 0) break;
        ssize_t k = readn(p[0], in + tot, (size_t)r);
        if (k > 0) tot += (size_t)k;
    }
    printf("{\"case\": \"splice_recv\", \"sent\": %zu, \"got\": %zu, \"intact\": %d, \"eagain_while_readable\": %ld}\n",
           sizeof msg, tot, tot == sizeof msg && !memcmp(msg, in, sizeof msg), eagain);
    close(p[0]); close(p[1]); close(c); close(s);
}

static void wait_readable(int fd) {
    struct pollfd pf = {fd, POLLIN, 0};
    poll(&pf, 1, 2000);
}

static void c_peek(void) {
    int c, s;
    pair(&c, &s);
    writen(c, "hello world", 11);
    wait_readable(s);
    char b[32] = {0}, b1[6] = {0}, b2[32] = {0};
    ssize_t r1 = recv(s, b, 5, MSG_PEEK);
    memcpy(b1, b, 5);
    ssize_t r2 = recv(s, b2, sizeof b2, MSG_DONTWAIT);
    printf("{\"case\": \"peek\", \"peeked\": %zd, \"peek\": \"%s\", \"read\": %zd, \"data\": \"%s\"}\n", r1, b1, r2,
           r2 > 0 ? b2 : "");
    close(c); close(s);
}

static void c_fionread(void) {
    int c, s;
    pair(&c, &s);
    writen(c, "hello world", 11);
    wait_readable(s);
    int inq = -1, inq2 = -1;
    for (int i = 0; i < 100 && inq != 11; i++) { ioctl(s, FIONREAD, &inq); if (inq != 11) usleep(10000); }
    char b[32];
    ssize_t r = recv(s, b, sizeof b, MSG_DONTWAIT);
    ioctl(s, FIONREAD, &inq2);
    printf("{\"case\": \"fionread\", \"before\": %d, \"read\": %zd, \"after\": %d}\n", inq, r, inq2);
    close(c); close(s);
}

/* A blocking read of fd that goes on past EAGAIN (which a blocking read must never return),
 * counting those in *eagain (at most a million): what the read finally returned. */
static ssize_t read_past_eagain(int fd, char *b, size_t n, long *eagain) {
    ssize_t r;
    for (;;) {
        r = read(fd, b, n);
        if (r < 0 && errno == EAGAIN && *eagain < 1000000) { (*eagain)++; continue; }
        return r;
    }
}

/* Writes data to fd after ms milliseconds, on a thread of its own. */
struct later { int fd; unsigned ms; const char *data; };
static void *write_later(void *a) {
    struct later *l = a;
    struct timespec ts = {l->ms / 1000, (long)(l->ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    writen(l->fd, l->data, strlen(l->data));
    return NULL;
}

static void c_waitall(void) {
    int c, s;
    pair(&c, &s);
    writen(c, "abc", 3);
    struct later x = {c, 100, "defg"};
    pthread_t th;
    pthread_create(&th, NULL, write_later, &x);
    char b[8] = {0};
    ssize_t r = recv(s, b, 7, MSG_WAITALL);
    pthread_join(th, NULL);
    printf("{\"case\": \"waitall\", \"got\": %zd}\n", r);
    close(c); close(s);
}

static void c_halfclose(void) {
    int c, s;
    pair(&c, &s);
    writen(c, "request", 7);
    shutdown(c, SHUT_WR);
    char b[64];
    ssize_t r = readn(s, b, sizeof b); /* the request, then EOF */
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP}, out = {0};
    epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
    int n = epoll_wait(ep, &out, 1, 1000);
    writen(s, "response", 8); /* the proxy still answers on its half */
    char b2[64];
    ssize_t r2 = readn(c, b2, 8);
    close(s);
    ssize_t r3 = read(c, b2, sizeof b2);
    printf("{\"case\": \"halfclose\", \"request\": %zd, \"rdhup\": %d, \"response\": %zd, \"eof\": %zd}\n", r,
           n == 1 && (out.events & EPOLLRDHUP) ? 1 : 0, r2, r3);
    close(ep); close(c);
}

static void c_close_unread(void) {
    int c, s;
    pair(&c, &s);
    writen(c, "unread data", 11);
    wait_readable(s);
    close(s);
    struct pollfd pf = {c, POLLIN, 0};
    poll(&pf, 1, 2000);
    char b[16];
    ssize_t r = read(c, b, sizeof b);
    printf("{\"case\": \"close_unread\", \"read\": %zd, \"errno\": \"%s\"}\n", r, r < 0 ? strerrorname_np(errno) : "");
    close(c);
}

static void c_epoll(void) {
    int c, s;
    pair(&c, &s);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN | EPOLLET}, out;
    epoll_ctl(ep, EPOLL_CTL_ADD, s, &ev);
    int n0 = epoll_wait(ep, &out, 1, 0);
    writen(c, "x", 1);
    int n1 = epoll_wait(ep, &out, 1, 2000);
    int n2 = epoll_wait(ep, &out, 1, 50);
    writen(c, "y", 1);
    int n3 = epoll_wait(ep, &out, 1, 2000);
    char b[4];
    ssize_t r = recv(s, b, sizeof b, MSG_DONTWAIT);
    struct pollfd pf = {s, POLLIN, 0};
    int p0 = poll(&pf, 1, 0);
    int ep2 = epoll_create1(0);
    struct epoll_event ev2 = {.events = EPOLLOUT};
    epoll_ctl(ep2, EPOLL_CTL_ADD, c, &ev2);
    int w = epoll_wait(ep2, &out, 1, 1000);
    printf("{\"case\": \"epoll\", \"empty\": %d, \"first\": %d, \"no_new_edge\": %d, \"second\": %d, \"read\": %zd,"
           " \"readable_after\": %d, \"writable\": %d}\n", n0, n1, n2, n3, r, p0, w);
    close(ep); close(ep2); close(c); close(s);
}

/* A reader that does not read: how much a non-blocking writer gets in within 1 s (64 MB at
 * most), and whether every byte then arrives. */
static void c_slow_reader(void) {
    int c, s;
    pair(&c, &s);
    fcntl(c, F_SETFL, O_NONBLOCK);
    static char buf[65536];
    size_t sent = 0, cap = (size_t)64 << 20;
    int blocked = 0;
    uint64_t end = now_ms() + 1000;
    while (now_ms() < end && sent < cap) {
        ssize_t w = write(c, buf, sizeof buf);
        if (w > 0) { sent += (size_t)w; continue; }
        if (w < 0 && errno == EAGAIN) { blocked = 1; break; }
        break;
    }
    fcntl(c, F_SETFL, 0);
    shutdown(c, SHUT_WR);
    size_t got = 0;
    ssize_t r;
    static char rb[1 << 20];
    while ((r = read(s, rb, sizeof rb)) > 0) got += (size_t)r;
    printf("{\"case\": \"slow_reader\", \"writer_blocked\": %d, \"queued\": %zu, \"got\": %zu}\n", blocked, sent, got);
    close(c); close(s);
}

/* A blocking read while another thread of the same process writes to the same socket (the
 * write-space wake-ups): the read must block until the answer, never return EAGAIN. */
struct bw { int fd; volatile int stop; size_t n; };
static void *busy_writer(void *a) {
    struct bw *x = a;
    static char b[65536];
    while (!x->stop) {
        ssize_t w = send(x->fd, b, sizeof b, MSG_NOSIGNAL);
        if (w <= 0) break;
        x->n += (size_t)w;
    }
    return NULL;
}
struct dr { int fd; volatile int stop; };
static void *slow_drain(void *a) {
    struct dr *x = a;
    static char b[65536];
    while (!x->stop) {
        if (read(x->fd, b, sizeof b) <= 0) break;
        usleep(200);
    }
    return NULL;
}

static void c_blocking_read(void) {
    int c, s;
    pair(&c, &s);
    struct bw x = {c, 0, 0};
    struct dr y = {s, 0};
    struct later z = {s, 1000, "ok"};
    pthread_t t1, t2, t3;
    pthread_create(&t1, NULL, busy_writer, &x);
    pthread_create(&t2, NULL, slow_drain, &y);
    pthread_create(&t3, NULL, write_later, &z);
    long eagain = 0;
    char b[16];
    ssize_t r = read_past_eagain(c, b, sizeof b, &eagain);
    x.stop = y.stop = 1;
    pthread_join(t3, NULL);
    shutdown(c, SHUT_RDWR);
    shutdown(s, SHUT_RDWR);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    printf("{\"case\": \"blocking_read\", \"eagain\": %ld, \"read\": %zd}\n", eagain, r);
    close(c); close(s);
}

/* A blocking read while the same socket's write side is shut (another thread, 0.1 s in): the
 * FIN's ACK changes the socket's state, which wakes the reader; it must go on waiting for the
 * answer (sent 1 s in), never return EAGAIN. */
struct shut { int fd; };
static void *shut_later(void *a) {
    usleep(100000);
    shutdown(((struct shut *)a)->fd, SHUT_WR);
    return NULL;
}

static void c_blocking_read_halfclose(void) {
    int c, s;
    pair(&c, &s);
    struct shut x = {c};
    struct later z = {s, 1000, "ok"};
    pthread_t t1, t2;
    pthread_create(&t1, NULL, shut_later, &x);
    pthread_create(&t2, NULL, write_later, &z);
    long eagain = 0;
    char b[16];
    ssize_t r = read_past_eagain(c, b, sizeof b, &eagain);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    printf("{\"case\": \"blocking_read_halfclose\", \"eagain\": %ld, \"read\": %zd}\n", eagain, r);
    close(c); close(s);
}

/* 1000 connections at once, each sending a random size (log-uniform, 1 byte to 16 MB) that the
 * proxy side echoes back; the app side checks every byte. At most 64 KB per connection is ahead
 * of what came back, so the whole stays within a few tens of MB whatever the transport. */
#define NCONN 1000
#define AHEAD (64 << 10)
struct conn { int c, s; size_t size, sent, got, pend_len; unsigned char *pend; uint32_t seed, seed_rx; int done; };
static unsigned char stream_byte(uint32_t *seed) {
    *seed = *seed * 1103515245u + 12345u;
    return (unsigned char)(*seed >> 16);
}

static void c_stress(void) {
    static struct conn cs[NCONN];
    static unsigned char buf[AHEAD];
    struct rlimit rl = {4 * NCONN + 64, 4 * NCONN + 64};
    setrlimit(RLIMIT_NOFILE, &rl);
    uint32_t r = 12345;
    size_t total = 0;
    int ep = epoll_create1(0);
    for (int i = 0; i < NCONN; i++) {
        r = r * 1103515245u + 12345u;
        double e = (double)(r >> 8) / (double)(1u << 24) * 24.0; /* 2^0 .. 2^24 */
        cs[i].size = (size_t)1 << (int)e;
        cs[i].size += (size_t)((double)cs[i].size * (e - (int)e));
        if (cs[i].size > (16u << 20)) cs[i].size = 16u << 20;
        cs[i].seed = cs[i].seed_rx = (uint32_t)i * 2654435761u + 1;
        total += cs[i].size;
        pair(&cs[i].c, &cs[i].s);
        fcntl(cs[i].c, F_SETFL, O_NONBLOCK);
        fcntl(cs[i].s, F_SETFL, O_NONBLOCK);
        struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.u64 = (uint64_t)i * 2};
        epoll_ctl(ep, EPOLL_CTL_ADD, cs[i].c, &ev);
        struct epoll_event ev2 = {.events = EPOLLIN, .data.u64 = (uint64_t)i * 2 + 1};
        epoll_ctl(ep, EPOLL_CTL_ADD, cs[i].s, &ev2);
    }
    int left = NCONN, bad = 0;
    uint64_t start = now_ms();
    struct epoll_event evs[256];
    while (left > 0 && now_ms() - start < 120000) {
        int n = epoll_wait(ep, evs, 256, 1000);
        for (int k = 0; k < n; k++) {
            int i = (int)(evs[k].data.u64 / 2), server = (int)(evs[k].data.u64 % 2);
            struct conn *x = &cs[i];
            if (x->done) continue;
            if (server) { /* echo what arrived, keeping what the socket does not take yet */
                if (!x->pend && !(x->pend = malloc(AHEAD))) die("malloc");
                if (x->pend_len < AHEAD) {
                    ssize_t got = read(x->s, x->pend + x->pend_len, AHEAD - x->pend_len);
                    if (got > 0) x->pend_len += (size_t)got;
                }
                if (x->pend_len) {
                    ssize_t w = write(x->s, x->pend, x->pend_len);
                    if (w > 0) {
                        memmove(x->pend, x->pend + w, x->pend_len - (size_t)w);
                        x->pend_len -= (size_t)w;
                    }
                }
                struct epoll_event ev = {.events = EPOLLIN | (x->pend_len ? EPOLLOUT : 0), .data.u64 = evs[k].data.u64};
                epoll_ctl(ep, EPOLL_CTL_MOD, x->s, &ev);
                continue;
            }
            if (evs[k].events & EPOLLIN) {
                ssize_t got;
                while ((got = read(x->c, buf, sizeof buf)) > 0) {
                    for (ssize_t j = 0; j < got; j++)
                        if (buf[j] != stream_byte(&x->seed_rx)) { bad++; break; }
                    x->got += (size_t)got;
                }
                if (x->got == x->size) {
                    x->done = 1;
                    left--;
                    epoll_ctl(ep, EPOLL_CTL_DEL, x->c, NULL);
                    epoll_ctl(ep, EPOLL_CTL_DEL, x->s, NULL);
                    close(x->c); close(x->s);
                    free(x->pend);
                    continue;
                }
            }
            while (x->sent < x->size && x->sent - x->got < AHEAD) {
                size_t chunk = x->size - x->sent;
                if (chunk > AHEAD - (x->sent - x->got)) chunk = AHEAD - (x->sent - x->got);
                uint32_t save = x->seed;
                for (size_t j = 0; j < chunk; j++) buf[j] = stream_byte(&x->seed);
                ssize_t w = write(x->c, buf, chunk);
                if (w <= 0) { x->seed = save; break; }
                if ((size_t)w < chunk) { /* rewind the generator to what was taken */
                    x->seed = save;
                    for (ssize_t j = 0; j < w; j++) stream_byte(&x->seed);
                }
                x->sent += (size_t)w;
            }
            if (x->sent == x->size) {
                struct epoll_event ev = {.events = EPOLLIN, .data.u64 = (uint64_t)i * 2};
                epoll_ctl(ep, EPOLL_CTL_MOD, x->c, &ev);
            }
        }
    }
    printf("{\"case\": \"stress\", \"connections\": %d, \"bytes\": %zu, \"unfinished\": %d, \"corrupt\": %d, \"ms\": %llu}\n",
           NCONN, total, left, bad, (unsigned long long)(now_ms() - start));
    close(ep);
}

static const struct { const char *name; void (*fn)(void); } CASES[] = {
    {"sizes", c_sizes}, {"sendfile", c_sendfile}, {"splice_send", c_splice_send}, {"splice_recv", c_splice_recv},
    {"peek", c_peek}, {"fionread", c_fionread}, {"waitall", c_waitall}, {"halfclose", c_halfclose},
    {"close_unread", c_close_unread}, {"epoll", c_epoll}, {"slow_reader", c_slow_reader},
    {"blocking_read", c_blocking_read}, {"blocking_read_halfclose", c_blocking_read_halfclose},
    {"stress", c_stress},
};

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s LISTEN_PORT TARGET_ADDR TARGET_PORT CASE...\n", argv[0]);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    setvbuf(stdout, NULL, _IOLBF, 0);
    lfd = socket(AF_INET6, SOCK_STREAM, 0);
    int one = 1, zero = 0;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    setsockopt(lfd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    struct sockaddr_in6 la = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)atoi(argv[1]))};
    if (bind(lfd, (struct sockaddr *)&la, sizeof la) || listen(lfd, 4096)) die("listen");
    memset(&target, 0, sizeof target);
    if (strchr(argv[2], ':')) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&target;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons((uint16_t)atoi(argv[3]));
        if (inet_pton(AF_INET6, argv[2], &a->sin6_addr) != 1) die("address");
        target_len = sizeof *a;
    } else {
        struct sockaddr_in *a = (struct sockaddr_in *)&target;
        a->sin_family = AF_INET;
        a->sin_port = htons((uint16_t)atoi(argv[3]));
        if (inet_pton(AF_INET, argv[2], &a->sin_addr) != 1) die("address");
        target_len = sizeof *a;
    }
    for (int i = 4; i < argc; i++) {
        int found = 0;
        for (unsigned k = 0; k < sizeof CASES / sizeof *CASES; k++) {
            if (strcmp(argv[i], CASES[k].name)) continue;
            found = 1;
            pid_t p = fork();
            if (p == 0) {
                alarm(strcmp(argv[i], "stress") ? 20 : 150);
                CASES[k].fn();
                _exit(0);
            }
            int st = 0;
            waitpid(p, &st, 0);
            if (WIFSIGNALED(st)) printf("{\"case\": \"%s\", \"hung\": 1, \"signal\": %d}\n", argv[i], WTERMSIG(st));
        }
        if (!found) { fprintf(stderr, "sockprobe: unknown case %s\n", argv[i]); return 2; }
    }
    return 0;
}
