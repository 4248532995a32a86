/* Ours (not a kernel header): the UAPI stddef.h plus NULL, which the kernel defines in its
 * include/linux/stddef.h (found before the UAPI one in bcc's include order). */
#ifndef RDR_KSTDDEF_H
#define RDR_KSTDDEF_H
#include <uapi/linux/stddef.h>
#undef NULL
#define NULL ((void *)0)
#endif
