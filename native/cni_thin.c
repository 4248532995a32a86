/* redirect-cni, the thin CNI plugin: hands every CNI request to the node agent.
 *
 * The container runtime execs the plugin once per pod event, so its start-up is on every
 * pod's start. This program does no CNI work of its own: it reads the request (the CNI_*
 * environment and the network config on stdin, both bounded), sends it as it got it to
 * redirect-agent's events socket in one "cni" message (docs/agent-protocol.md: the env in the
 * JSON, stdin as a sealed memfd passed with SCM_RIGHTS), waits for the answer and prints what
 * the agent's plugin code printed (its stdout arrives as a memfd), exiting with its code. The
 * agent parses and validates the config with redirect.cni.plugin, the same code as the Python
 * plugin, so codes and messages are the same.
 *
 * Read here, from the top level of the config only: cniVersion (VERSION is answered locally,
 * and errors raised here carry it; one of SUPPORTED, and 0.4.0 or later for CHECK), agentSocket
 * (default, also for null: /run/redirect/agent.sock; a path of at most 107 bytes, as
 * redirect.cni.netconf.PluginConf requires), agentTimeout (seconds, default 10) and agentDown,
 * what to do when no agent listens:
 *   "tryAgain"  (default) CNI error 11, so the runtime retries: fail closed (STATUS: error 50,
 *               "plugin not available", so the runtime starts no pods meanwhile);
 *   "inProcess" exec redirect-cni-python from this binary's directory (the Python plugin,
 *               written there by `redirect-cni install`) with the same env and stdin.
 * No agent listens when the socket does not exist, refuses connections, or is not the agent's
 * kind of socket (a stream socket: EPROTOTYPE).
 * A config whose cniVersion, agentSocket or agentDown is not as said above fails whatever an agent
 * would say, before one is asked: the answer is redirect-cni-python's (exec'd with the same env
 * and stdin), so code and message are the Python plugin's for any such config, whichever of its
 * checks fails first; if that can't be started, this plugin answers itself, in the CNI spec's
 * order: cniVersion first (4 missing or not a string, 1 unsupported or too old for CHECK), then
 * agentSocket, then agentDown (4).
 * A DEL when no agent listens execs redirect-cni-python whatever agentDown says (it removes the
 * in-pod rules, as the Python plugin's DEL does without an agent), and succeeds if that can't
 * be started: a DEL never fails for want of an agent.
 * agentTimeout bounds the whole exchange (connect, send, answer, reading the output), rounded
 * up to a microsecond, never down to "no timeout"; the output copied to stdout is the agent's
 * memfd, a regular file of at most MAX_OUTPUT bytes, or the request fails (an ADD the agent said
 * succeeded is then undone as below, by the Python plugin's DEL, before it fails).
 * An agent that goes away mid-request (closes without answering, a restart) or does not
 * answer within agentTimeout: error 11, whatever agentDown says (as the Python plugin answers
 * when its agent does so: "try again later"; 103 is the agent's refusal); the request may or may
 * not have been carried out, and the runtime retries ADD (or calls DEL), which either repeats or
 * undoes it. Never a success without the agent's. A DEL whose agent went away is done as when
 * no agent listens (redirect-cni-python's DEL, as the Python plugin falls back to its own
 * removal; it succeeds if that can't be started). An ADD whose agent went away runs the
 * Python plugin's DEL of the pod first (as when no agent runs: it removes what the pod's netns
 * holds of ours; bounded by agentTimeout + CLEANUP_EXTRA_S, then killed) and says whether that
 * worked; one that timed out leaves the pod to the agent, which is still at it.
 *
 * Bad input never crashes it: stdin larger than MAX_STDIN, not UTF-8, not JSON (strict RFC 8259,
 * scanned without recursion, nesting bounded by MAX_DEPTH levels, the top-level object's
 * included) or not an object gets error 6, a bad or oversized CNI_* variable error 7 (a DEL with
 * one succeeds having done nothing: check_env), as the Python plugin answers, checked in the
 * same order.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_STDIN (1 << 20)        /* redirect.cni.netconf.MAX_STDIN */
#define MAX_MESSAGE (64 * 1024)    /* redirect.ambient.agent.protocol.MAX_MESSAGE */
#define MAX_ENV_VALUE (32 * 1024)  /* redirect.cni.netconf.MAX_ENV_VALUE */
#define MAX_ENV_TOTAL (48 * 1024)  /* redirect.cni.netconf.MAX_ENV_TOTAL: all of them, as JSON */
#define MAX_OUTPUT (2 * MAX_STDIN) /* redirect.cni.netconf.MAX_OUTPUT: the plugin's stdout the agent answers with */
#define MAX_DEPTH 512
#define LATEST "1.1.0"
#define DEFAULT_SOCKET "/run/redirect/agent.sock"
#define DEFAULT_TIMEOUT_S 10.0
#define PYTHON_PLUGIN "redirect-cni-python"
#define CLEANUP_EXTRA_S 20.0 /* an ADD's cleanup DEL (the agent went away) may take agentTimeout + this */

enum { E_INCOMPATIBLE = 1, E_INVALID_CONFIG = 4, E_DECODE = 6, E_ENV = 7, E_TRY_AGAIN = 11, E_NOT_AVAILABLE = 50,
       E_SETUP = 100 };

/* `redirect-cni uninstall` removes a redirect-cni binary only if it holds this string */
__attribute__((used)) static const char INSTALL_MARK[] = "redirect-cni thin plugin (written by `redirect-cni install`)";

static const char *const SUPPORTED[] = {"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"};
#ifndef REDIRECT_VERSION /* the package version: the package build (setup.py) defines it */
#define REDIRECT_VERSION "unknown"
#endif
static const char *const ENV_NAMES[] = {"CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS",
                                        "CNI_IFNAME", "CNI_ARGS", "CNI_PATH"};

/* --- a growing buffer ------------------------------------------------------------------ */

struct buf {
    char *p;
    size_t n, cap;
};

static void die_oom(void) {
    /* nothing sensible to print without memory; the runtime sees a failure */
    _exit(1);
}

static void put(struct buf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) die_oom();
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void puts_(struct buf *b, const char *s) { put(b, s, strlen(s)); }

/* SUPPORTED, joined by ", ", each between two quotes q. */
static void put_supported(struct buf *b, const char *q) {
    for (size_t k = 0; k < sizeof SUPPORTED / sizeof SUPPORTED[0]; k++) {
        if (k) puts_(b, ", ");
        puts_(b, q);
        puts_(b, SUPPORTED[k]);
        puts_(b, q);
    }
}

/* `s` as a JSON string literal (s must be valid UTF-8). */
static void put_json_string(struct buf *b, const char *s, size_t n) {
    put(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[8];
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            put(b, esc, 2);
        } else if (c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            put(b, esc, 6);
        } else {
            put(b, (const char *)&s[i], 1);
        }
    }
    put(b, "\"", 1);
}

/* --- UTF-8 ---------------------------------------------------------------------------- */

/* Offset of the first byte that is not valid UTF-8 (as Python's strict decoder sees it), or -1. */
static long utf8_invalid_at(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        size_t len;
        uint32_t cp;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            len = 2;
            cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            len = 3;
            cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            len = 4;
            cp = c & 0x07;
        } else {
            return (long)i;
        }
        if (i + len > n) return (long)i;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return (long)i;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
            cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return (long)i;
        i += len;
    }
    return -1;
}

/* --- a JSON scanner: top-level members only, no recursion --------------------------------- */

struct span {
    const char *p;
    size_t n;
};

struct scan {
    const char *s;
    size_t n, i;
    const char *err; /* why scanning stopped */
};

static void ws(struct scan *sc) {
    while (sc->i < sc->n && (sc->s[sc->i] == ' ' || sc->s[sc->i] == '\t' || sc->s[sc->i] == '\n' ||
                             sc->s[sc->i] == '\r'))
        sc->i++;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A string at sc->i (its opening quote): checked and skipped. */
static int scan_string(struct scan *sc) {
    if (sc->i >= sc->n || sc->s[sc->i] != '"') {
        sc->err = "expected a string";
        return -1;
    }
    sc->i++;
    while (sc->i < sc->n) {
        unsigned char c = (unsigned char)sc->s[sc->i];
        if (c == '"') {
            sc->i++;
            return 0;
        }
        if (c < 0x20) {
            sc->err = "control character in a string";
            return -1;
        }
        if (c == '\\') {
            if (sc->i + 1 >= sc->n) break;
            char e = sc->s[sc->i + 1];
            if (e == 'u') {
                if (sc->i + 6 > sc->n) break;
                for (int k = 2; k < 6; k++)
                    if (hexval(sc->s[sc->i + k]) < 0) {
                        sc->err = "bad \\u escape";
                        return -1;
                    }
                sc->i += 6;
                continue;
            }
            if (!strchr("\"\\/bfnrt", e) || e == 0) {
                sc->err = "bad escape";
                return -1;
            }
            sc->i += 2;
            continue;
        }
        sc->i++;
    }
    sc->err = "unterminated string";
    return -1;
}

/* Any value at sc->i: checked (structure, strings) and skipped, nesting kept in a bounded stack. */
/* A member's key (its quoted text into *key, if given) and its ':' (whitespace between): the
 * scanner stops after the ':'. */
static int scan_key(struct scan *sc, struct span *key) {
    size_t k0 = sc->i;
    if (scan_string(sc) < 0) return -1;
    if (key) {
        key->p = sc->s + k0;
        key->n = sc->i - k0;
    }
    ws(sc);
    if (sc->i >= sc->n || sc->s[sc->i] != ':') {
        sc->err = "expected ':'";
        return -1;
    }
    sc->i++;
    return 0;
}

/* A number at sc->i, as RFC 8259 has it: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? */
static int scan_number(struct scan *sc) {
    const char *s = sc->s;
    size_t i = sc->i, n = sc->n;
#define DIGIT(k) ((k) < n && s[k] >= '0' && s[k] <= '9')
    if (i < n && s[i] == '-') i++;
    if (!DIGIT(i)) goto bad;
    if (s[i] == '0')
        i++;
    else
        while (DIGIT(i)) i++;
    if (i < n && s[i] == '.') {
        i++;
        if (!DIGIT(i)) goto bad;
        while (DIGIT(i)) i++;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < n && (s[i] == '+' || s[i] == '-')) i++;
        if (!DIGIT(i)) goto bad;
        while (DIGIT(i)) i++;
    }
#undef DIGIT
    sc->i = i;
    return 0;
bad:
    sc->i = i;
    sc->err = "bad number";
    return -1;
}

/* true, false or null at sc->i: 0 (skipped), or -1. */
static int scan_literal(struct scan *sc) {
    static const char *const words[] = {"true", "false", "null"};
    for (size_t k = 0; k < 3; k++) {
        size_t len = strlen(words[k]);
        if (sc->n - sc->i >= len && memcmp(sc->s + sc->i, words[k], len) == 0) {
            sc->i += len;
            return 0;
        }
    }
    sc->err = "unexpected character";
    return -1;
}

/* max_depth: how many more levels of objects and arrays may open (the config's top-level object
 * is the first of MAX_DEPTH, as redirect.cni.netconf counts them). */
static int skip_value(struct scan *sc, int max_depth) {
    char stack[MAX_DEPTH];
    int depth = 0;
    for (;;) {
        ws(sc);
        if (sc->i >= sc->n) {
            sc->err = "truncated: expected a value";
            return -1;
        }
        char c = sc->s[sc->i];
        if (c == '"') {
            if (scan_string(sc) < 0) return -1;
        } else if (c == '{' || c == '[') {
            if (depth >= max_depth) {
                sc->err = "nested deeper than 512 levels";
                return -1;
            }
            stack[depth++] = c;
            sc->i++;
            ws(sc);
            if (sc->i < sc->n && sc->s[sc->i] == (c == '{' ? '}' : ']')) {
                depth--;
                sc->i++;
            } else {
                if (c == '{' && scan_key(sc, NULL) < 0) return -1;
                continue; /* the first element's value */
            }
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            if (scan_number(sc) < 0) return -1;
        } else if (scan_literal(sc) < 0) {
            return -1;
        }
        /* after a value: close containers, or go on to the next element */
        for (;;) {
            if (depth == 0) return 0;
            ws(sc);
            if (sc->i >= sc->n) {
                sc->err = "truncated: unclosed object or array";
                return -1;
            }
            char d = sc->s[sc->i];
            char top = stack[depth - 1];
            if ((d == '}' && top == '{') || (d == ']' && top == '[')) {
                depth--;
                sc->i++;
                continue;
            }
            if (d != ',') {
                sc->err = "expected ',' or a closing bracket";
                return -1;
            }
            sc->i++;
            if (top == '{') {
                ws(sc);
                if (scan_key(sc, NULL) < 0) return -1;
            }
            break;
        }
    }
}

/* Decode the JSON string literal `v` (quotes included) into out (NUL-terminated, at most cap-1
 * bytes). -1 if too long, or it holds a NUL or a lone surrogate. */
static int unescape(struct span v, char *out, size_t cap) {
    size_t o = 0;
    for (size_t i = 1; i + 1 < v.n;) {
        char c = v.p[i];
        uint32_t cp;
        if (c != '\\') {
            if (o + 1 >= cap) return -1;
            out[o++] = c;
            i++;
            continue;
        }
        char e = v.p[i + 1];
        if (e != 'u') {
            const char *from = "\"\\/bfnrt", *to = "\"\\/\b\f\n\r\t";
            if (o + 1 >= cap) return -1;
            out[o++] = to[strchr(from, e) - from];
            i += 2;
            continue;
        }
        cp = (uint32_t)(hexval(v.p[i + 2]) << 12 | hexval(v.p[i + 3]) << 8 | hexval(v.p[i + 4]) << 4 |
                        hexval(v.p[i + 5]));
        i += 6;
        if (cp >= 0xD800 && cp <= 0xDBFF && i + 6 <= v.n - 1 && v.p[i] == '\\' && v.p[i + 1] == 'u') {
            uint32_t lo = (uint32_t)(hexval(v.p[i + 2]) << 12 | hexval(v.p[i + 3]) << 8 |
                                     hexval(v.p[i + 4]) << 4 | hexval(v.p[i + 5]));
            if (lo < 0xDC00 || lo > 0xDFFF) return -1;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            i += 6;
        } else if (cp >= 0xD800 && cp <= 0xDFFF) {
            return -1;
        }
        if (cp == 0 || o + 4 >= cap) return -1;
        if (cp < 0x80) {
            out[o++] = (char)cp;
        } else if (cp < 0x800) {
            out[o++] = (char)(0xC0 | cp >> 6);
            out[o++] = (char)(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            out[o++] = (char)(0xE0 | cp >> 12);
            out[o++] = (char)(0x80 | ((cp >> 6) & 0x3F));
            out[o++] = (char)(0x80 | (cp & 0x3F));
        } else {
            out[o++] = (char)(0xF0 | cp >> 18);
            out[o++] = (char)(0x80 | ((cp >> 12) & 0x3F));
            out[o++] = (char)(0x80 | ((cp >> 6) & 0x3F));
            out[o++] = (char)(0x80 | (cp & 0x3F));
        }
    }
    out[o] = 0;
    return 0;
}

/* The top-level members named in keys[] (values as raw spans; later duplicates win, as in
 * Python). 0: an object; 1: valid JSON but not an object; -1: not JSON (sc->err says why). */
static int top_members(struct scan *sc, const char *const *keys, struct span *vals, int nkeys) {
    if (sc->n == 0) return 0; /* empty stdin reads as {} (the Python plugin's rule); blank is not JSON */
    ws(sc);
    if (sc->i >= sc->n) {
        sc->err = "truncated: expected a value";
        return -1;
    }
    if (sc->s[sc->i] != '{') {
        if (skip_value(sc, MAX_DEPTH) < 0) return -1;
        ws(sc);
        if (sc->i != sc->n) {
            sc->err = "extra data after the value";
            return -1;
        }
        return 1;
    }
    sc->i++;
    ws(sc);
    if (sc->i < sc->n && sc->s[sc->i] == '}') {
        sc->i++;
    } else {
        for (;;) {
            ws(sc);
            struct span key;
            if (scan_key(sc, &key) < 0) return -1;
            ws(sc);
            size_t v0 = sc->i;
            if (skip_value(sc, MAX_DEPTH - 1) < 0) return -1; /* the top-level object is the first level */
            char name[64];
            if (unescape(key, name, sizeof name) == 0)
                for (int k = 0; k < nkeys; k++)
                    if (strcmp(name, keys[k]) == 0) {
                        vals[k].p = sc->s + v0;
                        vals[k].n = sc->i - v0;
                    }
            ws(sc);
            if (sc->i >= sc->n) {
                sc->err = "truncated: unclosed object";
                return -1;
            }
            if (sc->s[sc->i] == ',') {
                sc->i++;
                continue;
            }
            if (sc->s[sc->i] != '}') {
                sc->err = "expected ',' or '}'";
                return -1;
            }
            sc->i++;
            break;
        }
    }
    ws(sc);
    if (sc->i != sc->n) {
        sc->err = "extra data after the object";
        return -1;
    }
    return 0;
}

static int is_string(struct span v) { return v.p && v.n >= 2 && v.p[0] == '"'; }

/* Printable ASCII without a quote or a backslash: a string Python's repr shows as it is, in ''. */
static int plain(const char *s) {
    for (; *s; s++)
        if (*s < 0x20 || *s > 0x7e || *s == '\'' || *s == '\\') return 0;
    return 1;
}

/* A member's value in a message as the Python plugin shows it (redirect.errors.brief: its repr)
 * where that is simple: None (left out, or null), True, False, a short string of printable ASCII
 * in quotes; else its JSON text (at most 200 bytes). */
static void show_value(struct span v, char *out, size_t cap) {
    char text[64];
    if (!v.p || (v.n == 4 && memcmp(v.p, "null", 4) == 0))
        snprintf(out, cap, "None");
    else if (v.n == 4 && memcmp(v.p, "true", 4) == 0)
        snprintf(out, cap, "True");
    else if (v.n == 5 && memcmp(v.p, "false", 5) == 0)
        snprintf(out, cap, "False");
    else if (is_string(v) && unescape(v, text, sizeof text) == 0 && plain(text))
        snprintf(out, cap, "'%s'", text);
    else
        snprintf(out, cap, "%.*s", (int)(v.n > 200 ? 200 : v.n), v.p);
}

/* --- output --------------------------------------------------------------------------- */

static const char *version = LATEST; /* cniVersion of our error JSON */

static void write_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return;
        }
        p += w;
        n -= (size_t)w;
    }
}

__attribute__((noreturn, format(printf, 3, 4))) static void fail(int code, const char *details, const char *fmt,
                                                                  ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* msg and details may hold bytes from the config: keep only valid UTF-8 */
    long bad = utf8_invalid_at((const unsigned char *)msg, strlen(msg));
    if (bad >= 0) msg[bad] = 0;
    struct buf b = {0};
    puts_(&b, "{\"cniVersion\": \"");
    puts_(&b, version);
    puts_(&b, "\", \"code\": ");
    char num[16];
    snprintf(num, sizeof num, "%d", code);
    puts_(&b, num);
    puts_(&b, ", \"msg\": ");
    put_json_string(&b, msg, strlen(msg));
    puts_(&b, ", \"details\": ");
    size_t dn = details ? strlen(details) : 0;
    if (details && utf8_invalid_at((const unsigned char *)details, dn) >= 0) dn = 0;
    put_json_string(&b, details ? details : "", dn);
    puts_(&b, "}\n");
    write_all(1, b.p, b.n);
    exit(1);
}

/* --- the request ------------------------------------------------------------------------ */

static char *read_stdin(size_t *len) {
    size_t cap = 64 * 1024, n = 0;
    char *p = malloc(cap + 1);
    if (!p) die_oom();
    for (;;) {
        if (n == cap) {
            if (cap > MAX_STDIN) break;
            cap *= 2;
            if (cap > MAX_STDIN + 1) cap = MAX_STDIN + 1;
            char *q = realloc(p, cap + 1);
            if (!q) die_oom();
            p = q;
        }
        ssize_t r = read(0, p + n, cap - n);
        if (r < 0) {
            if (errno == EINTR) continue;
            fail(E_DECODE, strerror(errno), "cannot read the network config on stdin");
        }
        if (r == 0) break;
        n += (size_t)r;
    }
    if (n > MAX_STDIN) fail(E_DECODE, "", "the network config on stdin is larger than %d bytes", MAX_STDIN);
    p[n] = 0;
    *len = n;
    return p;
}

static int memfd_with(const char *data, size_t n) {
    int fd = memfd_create("redirect-cni-stdin", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) fail(E_TRY_AGAIN, strerror(errno), "memfd_create failed");
    size_t off = 0;
    while (off < n) {
        ssize_t w = write(fd, data + off, n - off);
        if (w < 0) {
            if (errno == EINTR) continue;
            fail(E_TRY_AGAIN, strerror(errno), "writing the request to a memfd failed");
        }
        off += (size_t)w;
    }
    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
    return fd;
}

/* The Python plugin next to this binary, with the same env and stdin (agentDown "inProcess", and
 * any DEL when no agent runs). Returns only if it could not be started, with why in `details`. */
static void exec_python(const char *data, size_t n, char *details, size_t cap) {
    char self[PATH_MAX], path[PATH_MAX + 32];
    ssize_t l = readlink("/proc/self/exe", self, sizeof self - 1);
    if (l <= 0) {
        snprintf(details, cap, "this plugin's own path is unknown: %s", strerror(errno));
        return;
    }
    self[l] = 0;
    char *slash = strrchr(self, '/');
    if (slash) *slash = 0;
    snprintf(path, sizeof path, "%s/%s", self, PYTHON_PLUGIN);
    int fd = memfd_with(data, n);
    lseek(fd, 0, SEEK_SET);
    if (dup2(fd, 0) < 0) {
        snprintf(details, cap, "dup2: %s", strerror(errno));
        return;
    }
    char *argv[] = {path, NULL};
    extern char **environ;
    execve(path, argv, environ);
    snprintf(details, cap, "%s: %s", path, strerror(errno));
}

static double now_s(void);

/* The length of s inside a JSON string as put_json_string writes it. */
static size_t json_len(const char *s, size_t n) {
    size_t out = n;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20) out += 5;
        else if (c == '"' || c == '\\') out += 1;
    }
    return out;
}

/* The CNI_* variables, checked before anything else of the request as the Python plugin checks
 * them (redirect.cni.netconf.check_env): each at most MAX_ENV_VALUE bytes of UTF-8, all of them at
 * most MAX_ENV_TOTAL as JSON (so the message fits MAX_MESSAGE), and for ADD, CHECK and DEL a
 * CNI_NETNS that is absolute or a bare name (a relative path would be resolved in the agent's
 * working directory). Error 7 names the first bad one; a DEL with it succeeds having done nothing
 * (no ADD took it, so nothing of ours is there; a DEL that failed would fail forever). */
static void check_env(const char *command) {
    char why[128] = "";
    const char *details = "";
    size_t total = 0;
    for (size_t k = 0; k < sizeof ENV_NAMES / sizeof ENV_NAMES[0] && !why[0]; k++) {
        const char *v = getenv(ENV_NAMES[k]);
        if (!v) continue;
        size_t vn = strlen(v);
        if (vn > MAX_ENV_VALUE)
            snprintf(why, sizeof why, "%s is longer than %d bytes", ENV_NAMES[k], MAX_ENV_VALUE);
        else if (utf8_invalid_at((const unsigned char *)v, vn) >= 0)
            snprintf(why, sizeof why, "%s is not UTF-8", ENV_NAMES[k]);
        else
            total += json_len(v, vn);
    }
    if (!why[0] && total > MAX_ENV_TOTAL)
        snprintf(why, sizeof why, "the CNI_* variables are longer than %d bytes in all (as JSON)", MAX_ENV_TOTAL);
    const char *netns = getenv("CNI_NETNS");
    int uses_netns = strcmp(command, "ADD") == 0 || strcmp(command, "CHECK") == 0 || strcmp(command, "DEL") == 0;
    if (!why[0] && uses_netns && netns && netns[0] != '/' && strchr(netns, '/')) {
        snprintf(why, sizeof why, "CNI_NETNS is a relative path: expected an absolute path, or a name under /run/netns");
        details = netns;
    }
    if (!why[0]) return;
    if (strcmp(command, "DEL") == 0) {
        fprintf(stderr, "redirect-cni: DEL: %s: nothing to remove\n", why);
        exit(0);
    }
    fail(E_ENV, details, "%s", why);
}

/* The Python plugin's DEL of this request's pod (same env and stdin, CNI_COMMAND=DEL), run to
 * the end or killed at `deadline`: what removes the pod's netns's capture of ours when the agent
 * went away in the middle of an ADD (the same DEL as when no agent runs). Its stdout is not ours
 * to print; its stderr is the runtime's. 0 when it succeeded, else why not in `why`. */
static int del_in_process(const char *data, size_t n, double deadline, char *why, size_t cap) {
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(why, cap, "fork: %s", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        int null = open("/dev/null", O_WRONLY | O_CLOEXEC);
        if (null < 0 || dup2(null, 1) < 0 || setenv("CNI_COMMAND", "DEL", 1) < 0) _exit(126);
        char details[PATH_MAX + 300];
        exec_python(data, n, details, sizeof details);
        fprintf(stderr, "redirect-cni: %s\n", details);
        _exit(127);
    }
    int status = 0;
    for (;;) { /* bounded: at most (deadline - now) / 10 ms turns */
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid) break;
        if (w < 0 && errno != EINTR) {
            snprintf(why, cap, "waitpid: %s", strerror(errno));
            return -1;
        }
        if (now_s() > deadline) {
            kill(pid, SIGKILL);
            while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
            snprintf(why, cap, "%s DEL did not finish in time (killed)", PYTHON_PLUGIN);
            return -1;
        }
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return 0;
    if (WIFEXITED(status))
        snprintf(why, cap, "%s DEL exited with %d", PYTHON_PLUGIN, WEXITSTATUS(status));
    else
        snprintf(why, cap, "%s DEL was killed by signal %d", PYTHON_PLUGIN, WTERMSIG(status));
    return -1;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* SO_SNDTIMEO of `s` to the time left until `deadline`, rounded up to whole microseconds and
 * never to zero: a timeval of {0,0} means no timeout at all. Bounds connect() (a listener whose
 * backlog is full) and sendmsg(). */
static void send_timeout(int s, double deadline) {
    double left = deadline - now_s();
    long long us = left > 0 ? (long long)(left * 1e6) : 0;
    if ((double)us < left * 1e6) us++;
    if (us < 1) us = 1;
    struct timeval tv = {(time_t)(us / 1000000), (suseconds_t)(us % 1000000)};
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

/* Milliseconds left until `deadline` for poll(), rounded up (0 once it has passed). */
static int ms_left(double deadline) {
    double left = (deadline - now_s()) * 1000;
    if (left <= 0) return 0;
    if (left > INT_MAX - 1) return INT_MAX - 1;
    int ms = (int)left;
    return (double)ms < left ? ms + 1 : ms;
}

int main(int argc, char **argv) {
    const char *command = getenv("CNI_COMMAND");
    if (!command && argc == 2 && strcmp(argv[1], "--version") == 0) { /* for people: which build a node has */
        struct buf b = {0};
        puts_(&b, "redirect-cni " REDIRECT_VERSION " (thin plugin)\nCNI protocol versions supported: ");
        put_supported(&b, "");
        puts_(&b, "\n");
        write_all(1, b.p, b.n);
        return 0;
    }
    if (!command)
        fail(E_ENV, "this is the thin redirect-cni plugin " REDIRECT_VERSION ", run by a container runtime; "
                    "install it with `redirect-cni install`",
             "CNI_COMMAND is not set");
    size_t len = 0;
    char *data = (strcmp(command, "VERSION") == 0 && isatty(0)) ? strdup("") : read_stdin(&len);
    if (!data) die_oom();

    int is_version = strcmp(command, "VERSION") == 0;
    if (!is_version) {
        static const char *const ok[] = {"ADD", "DEL", "CHECK", "STATUS", "GC"};
        int found = 0;
        for (size_t k = 0; k < sizeof ok / sizeof ok[0]; k++) found |= strcmp(command, ok[k]) == 0;
        if (!found) {
            char shown[64];
            snprintf(shown, sizeof shown, "%s", command);
            fail(E_ENV, "", "CNI_COMMAND='%s': expected ADD, DEL, CHECK, STATUS, GC or VERSION", shown);
        }
    }

    static const char *const keys[] = {"cniVersion", "agentSocket", "agentTimeout", "agentDown"};
    struct span vals[4] = {{0}};
    long bad = utf8_invalid_at((const unsigned char *)data, len);
    struct scan sc = {data, len, 0, NULL};
    int top = bad >= 0 ? -2 : top_members(&sc, keys, vals, 4);

    char cni_version[32] = "";
    if (top == 0 && is_string(vals[0])) unescape(vals[0], cni_version, sizeof cni_version);
    if (is_version) { /* answered here: {"cniVersion": <asked, or latest>, "supportedVersions": [...]} */
        struct buf b = {0};
        puts_(&b, "{\"cniVersion\": ");
        if (top == 0 && is_string(vals[0]) && vals[0].n > 2)
            put(&b, vals[0].p, vals[0].n);
        else
            puts_(&b, "\"" LATEST "\"");
        puts_(&b, ", \"supportedVersions\": [");
        put_supported(&b, "\"");
        puts_(&b, "]}\n");
        write_all(1, b.p, b.n);
        return 0;
    }
    int version_ok = 0; /* a string, one of SUPPORTED */
    for (size_t k = 0; k < sizeof SUPPORTED / sizeof SUPPORTED[0]; k++)
        if (top == 0 && is_string(vals[0]) && strcmp(cni_version, SUPPORTED[k]) == 0) {
            version = SUPPORTED[k];
            version_ok = 1;
        }
    if (top == -2) {
        char d[64];
        snprintf(d, sizeof d, "invalid UTF-8 at byte %ld", bad);
        fail(E_DECODE, d, "cannot decode the network config on stdin");
    }
    if (top < 0) {
        char d[128];
        snprintf(d, sizeof d, "%s at byte %zu", sc.err ? sc.err : "invalid JSON", sc.i);
        fail(E_DECODE, d, "cannot decode the network config on stdin");
    }
    if (top == 1) fail(E_DECODE, "", "the network config on stdin must be a JSON object");
    check_env(command);

    /* What of the config this plugin reads itself, checked (not failed on yet). */
    int check_too_old = version_ok && strcmp(command, "CHECK") == 0 &&
                        (strcmp(cni_version, "0.3.0") == 0 || strcmp(cni_version, "0.3.1") == 0);
    char sock_path[sizeof(((struct sockaddr_un *)0)->sun_path)] = DEFAULT_SOCKET;
    int sock_null = vals[1].p && vals[1].n == 4 && memcmp(vals[1].p, "null", 4) == 0; /* as if left out */
    int sock_ok = !vals[1].p || sock_null ||
                  (is_string(vals[1]) && unescape(vals[1], sock_path, sizeof sock_path) == 0 && sock_path[0]);
    double timeout = DEFAULT_TIMEOUT_S;
    if (vals[2].p) {
        char num[32];
        snprintf(num, sizeof num, "%.*s", (int)(vals[2].n < 31 ? vals[2].n : 31), vals[2].p);
        char *end;
        double t = strtod(num, &end);
        if (*end == 0 && t > 0 && t <= 300) timeout = t; /* else the agent's plugin code says why */
    }
    int in_process = 0, down_ok = 1;
    if (vals[3].p) {
        char pol[32] = "";
        if (is_string(vals[3])) unescape(vals[3], pol, sizeof pol);
        in_process = strcmp(pol, "inProcess") == 0;
        down_ok = in_process || strcmp(pol, "tryAgain") == 0;
    }
    if (!version_ok || check_too_old || !sock_ok || !down_ok) {
        /* A config the request fails on whatever the agent would say: the Python plugin's answer
         * (its checks, in its order, word for word), else this plugin's own, cniVersion first. */
        char details[PATH_MAX + 300];
        exec_python(data, len, details, sizeof details);
        char shown[256];
        show_value(vals[0], shown, sizeof shown);
        if (!is_string(vals[0])) fail(E_INVALID_CONFIG, "", "cniVersion=%s: missing or not a string", shown);
        if (!version_ok) {
            struct buf sup = {0};
            puts_(&sup, "supported: ");
            put_supported(&sup, "");
            fail(E_INCOMPATIBLE, sup.p, "cniVersion=%s: unsupported", shown);
        }
        if (check_too_old) fail(E_INCOMPATIBLE, "", "cniVersion=%s: CHECK needs 0.4.0 or later", shown);
        if (!sock_ok)
            fail(E_INVALID_CONFIG, "", "agentSocket=%.*s: expected a path of at most %zu bytes",
                 (int)(vals[1].n > 200 ? 200 : vals[1].n), vals[1].p, sizeof sock_path - 1);
        fail(E_INVALID_CONFIG, "", "agentDown=%.*s: expected \"tryAgain\" or \"inProcess\"",
             (int)(vals[3].n > 100 ? 100 : vals[3].n), vals[3].p);
    }

    /* the message: {"v":1,"type":"cni","cni":{"env":{...},"stdin_len":N}} + the stdin memfd */
    struct buf msg = {0};
    puts_(&msg, "{\"v\":1,\"type\":\"cni\",\"cni\":{\"env\":{");
    int first = 1;
    for (size_t k = 0; k < sizeof ENV_NAMES / sizeof ENV_NAMES[0]; k++) {
        const char *v = getenv(ENV_NAMES[k]);
        if (!v) continue;
        size_t vn = strlen(v); /* (checked by check_env) */
        if (!first) puts_(&msg, ",");
        first = 0;
        put_json_string(&msg, ENV_NAMES[k], strlen(ENV_NAMES[k]));
        puts_(&msg, ":");
        put_json_string(&msg, v, vn);
    }
    char tail[64];
    snprintf(tail, sizeof tail, "},\"stdin_len\":%zu}}", len);
    puts_(&msg, tail);
    if (msg.n > MAX_MESSAGE) fail(E_SETUP, "", "the request is larger than %d bytes", MAX_MESSAGE); /* (can't be) */

    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0) fail(E_TRY_AGAIN, strerror(errno), "socket() failed");
    double deadline = now_s() + timeout; /* the whole exchange: connect, send, answer, output */
    send_timeout(s, deadline);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    memcpy(addr.sun_path, sock_path, strlen(sock_path) + 1);
    if (connect(s, (struct sockaddr *)&addr, sizeof addr) < 0) {
        int err = errno;
        char why[600];
        snprintf(why, sizeof why, "%s: %s", sock_path, strerror(err));
        /* No agent there: nothing listens (ENOENT, ECONNREFUSED), or what listens is no agent
         * (EPROTOTYPE: a stream socket, which the agent's never is). */
        if (err == ENOENT || err == ECONNREFUSED || err == EPROTOTYPE) {
            int is_del = strcmp(command, "DEL") == 0;
            if (in_process || is_del) {
                char details[PATH_MAX + 300];
                exec_python(data, len, details, sizeof details);
                /* A DEL never fails for want of an agent (as with the Python plugin): the pod's
                 * netns goes with the pod, and what lives outside it the agent removes when it
                 * starts (node sets) or a later DEL or GC does (eBPF map entries). */
                if (is_del) return 0;
                fail(E_TRY_AGAIN, details, "the node agent is not running and the in-process plugin could not be "
                                           "started (agentDown: inProcess)");
            }
            if (strcmp(command, "STATUS") == 0) /* the runtime should not start pods until it is back */
                fail(E_NOT_AVAILABLE, why, "the node agent is not running (agentDown: tryAgain)");
            fail(E_TRY_AGAIN, why, "the node agent is not running (agentDown: tryAgain)");
        }
        fail(E_TRY_AGAIN, why, "cannot reach the node agent");
    }
    int fd = memfd_with(data, len);
    char cbuf[CMSG_SPACE(sizeof(int))];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {msg.p, msg.n};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    send_timeout(s, deadline);
    ssize_t sent;
    do sent = sendmsg(s, &mh, MSG_NOSIGNAL);
    while (sent < 0 && errno == EINTR);
    if (sent < 0) fail(E_TRY_AGAIN, strerror(errno), "sending the request to the node agent at %s failed", sock_path);
    close(fd);

    /* the answer: {"v":1,"type":"result","ok":true,"rc":N,...} + a memfd with the plugin's stdout */
    static char reply[MAX_MESSAGE + 1];
    char rbuf[CMSG_SPACE(sizeof(int) * 4)];
    ssize_t got;
    for (;;) {
        int left = ms_left(deadline);
        struct pollfd pfd = {s, POLLIN, 0};
        int pr = left > 0 ? poll(&pfd, 1, left) : 0;
        if (pr < 0 && errno == EINTR) continue;
        if (pr <= 0)
            fail(E_TRY_AGAIN, sock_path, "the node agent did not answer within %g s (agentTimeout)", timeout);
        iov.iov_base = reply;
        iov.iov_len = sizeof reply;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = rbuf;
        mh.msg_controllen = sizeof rbuf;
        got = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
        if (got < 0 && errno == EINTR) continue;
        break;
    }
    if (got == 0 || (got < 0 && errno == ECONNRESET)) {
        /* The agent went away (killed, restarting) in the middle of the request. An ADD may have
         * been half done there: remove what the pod's netns holds of ours now, as a DEL without an
         * agent does, before answering "try again"; the agent removes what it keeps elsewhere
         * (node sets, the proxy's listeners) when it starts. */
        const char *closed = got == 0 ? "connection closed" : strerror(errno);
        if (strcmp(command, "ADD") == 0) {
            char why[PATH_MAX + 400] = "";
            if (del_in_process(data, len, now_s() + timeout + CLEANUP_EXTRA_S, why, sizeof why) == 0)
                fail(E_TRY_AGAIN, closed, "the node agent at %s went away without answering (restarting?); what "
                                          "the pod's netns held of ours was removed", sock_path);
            fail(E_TRY_AGAIN, why, "the node agent at %s went away without answering (restarting?); removing what "
                                   "the pod's netns holds of ours failed", sock_path);
        }
        if (strcmp(command, "DEL") == 0) { /* as when no agent listens: a DEL never fails for want of one */
            char details[PATH_MAX + 300];
            exec_python(data, len, details, sizeof details);
            return 0;
        }
        fail(E_TRY_AGAIN, closed, "the node agent at %s went away without answering (restarting?)", sock_path);
    }
    if (got < 0)
        fail(E_TRY_AGAIN, strerror(errno), "reading the node agent's answer at %s failed", sock_path);
    int outfd = -1;
    for (cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            size_t nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t k = 0; k < nfd; k++) {
                int f;
                memcpy(&f, CMSG_DATA(cm) + k * sizeof(int), sizeof f);
                if (outfd < 0) outfd = f;
                else close(f);
            }
        }
    if (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) fail(E_SETUP, "", "the node agent's answer was truncated");
    static const char *const rkeys[] = {"type", "ok", "rc", "error", "reason"};
    struct span r[5] = {{0}};
    struct scan rs = {reply, (size_t)got, 0, NULL};
    if (utf8_invalid_at((const unsigned char *)reply, (size_t)got) >= 0 || top_members(&rs, rkeys, r, 5) != 0 ||
        !r[0].p || r[0].n != 8 || memcmp(r[0].p, "\"result\"", 8) != 0 || !r[1].p)
        fail(E_SETUP, "", "the node agent's answer is not a result message");
    if (r[1].n != 4 || memcmp(r[1].p, "true", 4) != 0) {
        char err[700] = "", reason[64] = "";
        if (is_string(r[3])) unescape(r[3], err, sizeof err);
        if (is_string(r[4])) unescape(r[4], reason, sizeof reason);
        fail(E_SETUP, err, "the node agent refused the request (%s)", reason[0] ? reason : "no reason given");
    }
    int rc = r[2].p && r[2].n == 1 && r[2].p[0] >= '0' && r[2].p[0] <= '9' ? r[2].p[0] - '0' : -1;
    if (rc < 0 || outfd < 0) fail(E_SETUP, "", "the node agent's answer has no exit code or output");
    /* The output: a regular file (the agent's memfd) of at most MAX_OUTPUT bytes, read in full
     * before anything is printed, within agentTimeout; anything else (a device such as
     * /dev/zero, a pipe, a huge file) is not an answer. */
    struct stat st;
    if (fstat(outfd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size < 0 || st.st_size > MAX_OUTPUT) {
        /* The agent's plugin code refuses, before installing anything, an ADD whose result would be
         * longer (redirect.cni.netconf.encode_result): an agent that answers so anyway is not
         * believed, and the capture of a successful ADD is removed before the ADD fails. */
        if (rc == 0 && strcmp(command, "ADD") == 0) {
            char why[PATH_MAX + 400] = "";
            if (del_in_process(data, len, now_s() + timeout + CLEANUP_EXTRA_S, why, sizeof why) == 0)
                fail(E_SETUP, "", "the node agent's output is not a file of at most %d bytes; what the pod's netns "
                                  "held of ours was removed", MAX_OUTPUT);
            fail(E_SETUP, why, "the node agent's output is not a file of at most %d bytes; removing what the pod's "
                               "netns holds of ours failed", MAX_OUTPUT);
        }
        fail(E_SETUP, "", "the node agent's output is not a file of at most %d bytes", MAX_OUTPUT);
    }
    char *out = malloc((size_t)st.st_size + 1);
    if (!out) die_oom();
    size_t have = 0;
    while (have < (size_t)st.st_size) {
        if (now_s() > deadline)
            fail(E_TRY_AGAIN, sock_path, "the node agent's output was not read within %g s (agentTimeout)", timeout);
        ssize_t n = pread(outfd, out + have, (size_t)st.st_size - have, (off_t)have);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        have += (size_t)n;
    }
    write_all(1, out, have);
    return rc;
}
