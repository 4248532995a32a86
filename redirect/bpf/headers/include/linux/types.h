/* Ours (not a kernel header). With bcc's include order a kernel tree's include/linux/types.h
 * comes before the UAPI one, and bcc's helpers.h uses the kernel-side type names it defines
 * (u8..s64, size_t, uintptr_t): the UAPI types plus those names, nothing else. */
#ifndef RDR_KTYPES_H
#define RDR_KTYPES_H
#include <uapi/linux/types.h>
#include <linux/stddef.h>

typedef __u8 u8;
typedef __s8 s8;
typedef __u16 u16;
typedef __s16 s16;
typedef __u32 u32;
typedef __s32 s32;
typedef __u64 u64;
typedef __s64 s64;
typedef __kernel_size_t size_t;
typedef unsigned long uintptr_t;
#endif
