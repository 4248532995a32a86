/* Ours: empty on purpose. bcc force-includes its own copy of the UAPI bpf.h
 * (/virtual/include/bcc/bpf.h, guarded by _UAPI__LINUX_BPF_H__) before any source; the
 * programs and bcc's helpers.h then #include <uapi/linux/bpf.h>, which must name a file but
 * adds nothing. The programs are built against bcc's copy, as they were against a kernel tree
 * (whose include/uapi/linux/bpf.h has the same guard). */
