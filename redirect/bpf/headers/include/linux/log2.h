/* Ours (not a kernel header): empty on purpose. bcc's helpers.h includes <linux/log2.h> for
 * roundup_pow_of_two in BPF_STACK_TRACE, which the programs do not use; the kernel's header
 * pulls in a large part of the non-UAPI tree. A program that uses BPF_STACK_TRACE fails to
 * compile here, by name. */
